"""The config reference (``docs/config.md``), rendered from the pydantic models themselves.

Every key, its type, its default and its description come from :class:`~longboat.config.Config`
and the section models it holds, walked through ``model_fields``, so the page cannot drift from
the schema: ``tests/test_docs.py`` fails when the committed page differs from :func:`render`.
Regenerate it with::

    python -m longboat.config.reference > docs/config.md
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from longboat.config import Config

#: The command that regenerates the page; the test's failure message names it.
COMMAND = "python -m longboat.config.reference > docs/config.md"

_HEADER = f"""\
# Config reference

<!-- Generated from the pydantic models in src/longboat/config/ by `{COMMAND}`;
     edit the models' descriptions and docstrings, not this page. -->

Every key longboat's config accepts: TOML, JSON or YAML (`longboat.initialize(..., config=...)`,
`longboat.load_config(path)`), or a dict. A key not listed here is refused by name, a misspelt
one with the key meant. Sections are TOML tables (`[zero]`, `[zero.offload_optimizer]`); in a
dict or JSON they are nested objects. DeepSpeed's JSON dialect is translated into these keys
(see [configuring.md](configuring.md)); `longboat config explain FILE --world-size N` prints
every resolved value and where it came from.
"""


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (``X``, or ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _section_model(models[0])
    return None


_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


def _type(annotation: Any) -> str:
    """A reader's name for a field's type: ``integer``, ```"a"`, `"b"` or `"c"```, ..."""
    if annotation in _NAMES:
        return _NAMES[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return _either([f"`{_value(a)}`" for a in args])
    if origin in (Union, types.UnionType):
        return _either([_type(a) for a in args if a is not type(None)])
    if origin is list:
        return f"list of {_type(args[0])}s" if args else "list"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _value(value: Any) -> str:
    """A value as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{_value(field.get_default(call_default_factory=True))}`"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    return f"`{_value(field.default)}`"


def _prose(text: str | None) -> str:
    """A docstring or description as Markdown: reST roles and double backquotes made plain."""
    if not text:
        return ""
    text = inspect.cleandoc(text)
    text = re.sub(r":[a-z]+:`~?([^`]*?)`", lambda m: f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in rows]
    return lines


def _section(path: str, model: type[BaseModel], field: FieldInfo | None) -> list[str]:
    """One section's heading, what it is for, its keys, then its own sections."""
    lines = [f"## `[{path}]`", ""]
    about = _prose(model.__doc__)
    if field is not None and field.description:
        said = _prose(field.description)
        about = f"{about} {said[0].upper()}{said[1:]}.".strip()
    if field is not None and field.default is None:
        about += " Optional: absent unless the config gives it."
    if about:
        lines += [about.strip(), ""]
    rows, nested = [], []
    for name, sub in model.model_fields.items():
        inner = _section_model(sub.annotation)
        if inner is not None:
            nested.append((f"{path}.{name}", inner, sub))
            rows.append((f"`{name}`", "section", f"see `[{path}.{name}]`", ""))
        else:
            rows.append(
                (f"`{name}`", _type(sub.annotation), _default(sub), _prose(sub.description))
            )
    lines += [*_table(rows), ""]
    for sub_path, inner, sub in nested:
        lines += _section(sub_path, inner, sub)
    return lines


def render(config: type[BaseModel] = Config) -> str:
    """The config reference as Markdown: the top-level keys, then every section in order."""
    lines = [_HEADER, "## Top level", "", _prose(config.__doc__), ""]
    rows, sections = [], []
    for name, field in config.model_fields.items():
        model = _section_model(field.annotation)
        if model is not None:
            sections.append((name, model, field))
            rows.append((f"`{name}`", "section", f"see [`[{name}]`](#{name})", ""))
        else:
            rows.append(
                (f"`{name}`", _type(field.annotation), _default(field), _prose(field.description))
            )
    lines += [*_table(rows), ""]
    for name, model, field in sections:
        lines += [f'<a id="{name}"></a>', ""]
        lines += _section(name, model, field)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
