"""Which strategies, parallelisms and features combine: the one table of the compositions
longboat refuses, each with its reason and what to do instead.

[Note: compositions] Every refusal of a combination comes from :data:`RULES`. A rule names two
settings, says whether they cannot combine by nature or are not built together yet, and carries
an example config it refuses (``tests/test_compositions.py`` runs every example through the real
entry point). Two moments read the table:

- **config**: what the config alone decides is refused when the config is loaded
  (``longboat.config.load`` calls :func:`refusal`, for a dict, a file or a ``Config``), so on
  every rank and before any process group exists;
- **build**: what also depends on the model, the optimizer or the device (an optimizer that is
  not element-wise under ZeRO, parameters on the meta device, ...) is refused by
  :func:`refuse_built` once those are at hand, from :class:`Facts` the caller gathers.

``docs/compositions.md`` is rendered from this table (the refusals, and a matrix of strategies
against features evaluated through it), so the page cannot drift: ``tests/test_docs.py`` fails
when the committed page differs. Regenerate it with::

    python -m longboat.config.compositions > docs/compositions.md
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from longboat.config.compositions.features import FEATURES
from longboat.config.compositions.parallel import PARALLEL
from longboat.config.compositions.recovery import RECOVERY
from longboat.config.compositions.rule import Facts, Rule
from longboat.config.errors import ConfigError
from longboat.config.sections import Config

#: The table, in the order its rules are checked (the first that applies is the refusal).
RULES: tuple[Rule, ...] = (*PARALLEL, *FEATURES, *RECOVERY)
#: Each rule by its name.
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}


def refusal(config: Config, facts: Facts | None = None) -> str | None:
    """The first refusal of ``config`` (with ``facts``, the build-time rules' too), else None.

    Without facts, a rule about an optimizer reads it from ``config.optimizer``."""
    f = facts if facts is not None else Facts()
    for rule in RULES:
        if rule.applies(config, f):
            return rule.message(config, f)
    return None


def refuse_built(config: Config, facts: Facts) -> None:
    """Raise a ConfigError with the first rule ``config`` and ``facts`` break together."""
    why = refusal(config, facts)
    if why is not None:
        raise ConfigError(why)


def explain(name: str) -> str:
    """Rule ``name``'s refusal, rendered on its own example."""
    rule = BY_NAME[name]
    return rule.message(unchecked(rule.example), rule.example_facts)


def unchecked(data: Mapping[str, Any]) -> Config:
    """``data`` as a Config, validated but not by this table (to render what it refuses)."""
    return Config.model_validate(dict(data))


__all__ = ["BY_NAME", "RULES", "Facts", "Rule", "explain", "refusal", "refuse_built", "unchecked"]
