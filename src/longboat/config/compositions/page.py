"""``docs/compositions.md``, rendered from the table of compositions itself ([Note:
compositions]): a matrix of strategies against parallelisms and features, each cell evaluated by
loading its config (and, for what the model or optimizer decide, by the table with their facts),
then every rule with its reason. ``tests/test_docs.py`` fails when the committed page differs
from :func:`render`. Regenerate it with::

    python -m longboat.config.compositions > docs/compositions.md
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from longboat.config.compositions import RULES, unchecked
from longboat.config.compositions.rule import Facts, Rule
from longboat.config.errors import ConfigError
from longboat.config.loading import load_config

#: The command that regenerates the page; the test's failure message names it.
COMMAND = "python -m longboat.config.compositions > docs/compositions.md"

_DISK = {"device": "disk", "path": "/tmp/swap"}

#: The matrix's rows: a strategy as a user configures it (4 processes).
STRATEGIES: tuple[tuple[str, Mapping[str, Any]], ...] = (
    ("single", {"strategy": "single"}),
    ("replicate", {"strategy": "replicate"}),
    ("ZeRO-1", {"strategy": "zero", "zero": {"stage": 1}}),
    ("ZeRO-2", {"strategy": "zero", "zero": {"stage": 2}}),
    ("ZeRO-3", {"strategy": "zero", "zero": {"stage": 3}}),
    ("parameter server, sync", {"strategy": "parameter_server"}),
    (
        "parameter server, async",
        {"strategy": "parameter_server", "parameter_server": {"mode": "async"}},
    ),
)

#: The matrix's columns: a parallelism or feature, the config that turns it on, the facts of a
#: model or optimizer it stands for, and the strategies it means something under (else "—").
FEATURES: tuple[tuple[str, Mapping[str, Any], Facts, tuple[str, ...] | None], ...] = (
    ("pipeline (`mesh.pp = 2`)", {"mesh": {"pp": 2}}, Facts(), None),
    ("tensor parallel (`mesh.tp = 2`)", {"mesh": {"tp": 2}}, Facts(), None),
    ("hybrid shards (`mesh.dp_replicate = 2`)", {"mesh": {"dp_replicate": 2}}, Facts(), ("zero",)),
    ("compression (PowerSGD)", {"compression": {"method": "powersgd"}}, Facts(), None),
    ("1-bit Adam", {"optimizer": {"type": "OneBitAdam"}}, Facts(), None),
    ("`data.remainder = 'join'`", {"data": {"remainder": "join"}}, Facts(), None),
    ("`comm.hierarchical`", {"comm": {"hierarchical": True}}, Facts(), None),
    ("`comm.groups = 2`", {"comm": {"groups": 2}}, Facts(), None),
    ("fp16", {"precision": {"dtype": "fp16"}}, Facts(), None),
    ("bf16", {"precision": {"dtype": "bf16"}}, Facts(), None),
    (
        "bf16 parameters (`precision.param_dtype`)",
        {"precision": {"dtype": "bf16", "param_dtype": "bf16"}},
        Facts(),
        None,
    ),
    ("gradient clipping", {"gradient_clipping": 1.0}, Facts(), None),
    (
        "in-job recovery (`recovery.in_job`)",
        {"recovery": {"in_job": True}},
        Facts(),
        ("replicate", "zero", "parameter_server"),
    ),
    ("sync batch norm", {"sync_batchnorm": True}, Facts(), None),
    (
        "activation checkpointing",
        {"activation_checkpointing": {"classes": ["Block"]}},
        Facts(),
        None,
    ),
    ("`torch.compile`", {"compile": True}, Facts(), None),
    (
        "optimizer state in CPU memory",
        {"zero": {"offload_optimizer": {"device": "cpu"}}},
        Facts(),
        ("zero",),
    ),
    ("optimizer state on disk", {"zero": {"offload_optimizer": _DISK}}, Facts(), ("zero",)),
    ("parameters on disk", {"zero": {"offload_param": _DISK}}, Facts(), ("zero",)),
    (
        "an optimizer that is not element-wise (LAMB)",
        {},
        Facts(optimizer="Lamb", elementwise=False),
        None,
    ),
    ("a model built on the meta device", {}, Facts(meta=True), None),
)


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and k in out else v
    return out


def _cell(row: Mapping[str, Any], column: Mapping[str, Any], facts: Facts) -> str:
    """What longboat says to ``row`` with ``column``: accepted, or the rule that refuses it."""
    data = _merge(row, column)
    config = unchecked(data)
    try:
        load_config(data)
    except ConfigError as e:
        # Every refusal of a cell is one of the table's: a refusal from elsewhere fails here.
        rule = next((r for r in RULES if r.applies(config, Facts())), None)
        if rule is None:
            raise AssertionError(f"{data} is refused outside the table: {e}") from None
        return f"✗ [{rule.name}](#{rule.name})"
    strategy = config.resolved_strategy(4)
    # The strategy's own answer to a model on the meta device: only ZeRO-3 makes one.
    deferred = strategy == "zero" and config.zero.stage == 3
    full = replace(facts, strategy=strategy, deferred_init=deferred)
    rule = next((r for r in RULES if r.applies(config, full)), None)
    if rule is not None:
        return f"✗ [{rule.name}](#{rule.name})"
    return "✓"


def _matrix() -> list[str]:
    names = [name for name, _ in STRATEGIES]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, column, facts, only in FEATURES:
        cells = []
        for _, row in STRATEGIES:
            if only is not None and row.get("strategy") not in only:
                cells.append("—")
            else:
                cells.append(_cell(row, column, facts))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _rule_rows(rules: tuple[Rule, ...]) -> list[str]:
    lines = ["| Rule | Setting | With | Refused | Moment | The refusal, on its example |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rules:
        text = r.message(unchecked(r.example), r.example_facts).replace("|", "\\|")
        lines.append(
            f'| <a id="{r.name}"></a>`{r.name}` | {r.setting} | {r.other} | {r.kind} | '
            f"{r.moment} | {text} |"
        )
    return lines


_HEADER = f"""\
# What combines

<!-- Generated from the table of compositions in src/longboat/config/compositions/ by
     `{COMMAND}`; edit the rules, not this page. -->

Every combination of strategies, parallelisms and features that longboat refuses is one rule of
one table (`longboat/config/compositions/`); loading a config checks the rules the config alone
decides, on every rank, before any process group exists, and the engine checks the rules that
need the model or the optimizer once it has them. A refusal names both settings, says why, and
says what to do instead.

## Strategies against features

Each cell loads the strategy's config with the feature turned on (and, for the last rows, asks
the table with the model's or the optimizer's facts): ✓ is accepted, ✗ names the rule that
refuses it. — marks a feature that belongs to another strategy's section. Accepted is what the
table says, not a measurement: [testing.md](testing.md) lists what the tests check against plain
PyTorch.
"""


def render() -> str:
    """The page as Markdown."""
    lines = [_HEADER, *_matrix(), "", "## Every rule", ""]
    lines += [
        "*by nature*: the two cannot mean anything together; *not built yet*: they could, and "
        "longboat does not do it so far. *config*: refused on loading the config; *build*: "
        "refused by the engine, which knows the model and the optimizer (a rule about 1-bit "
        "Adam is checked on loading too when `optimizer.type` names it).",
        "",
    ]
    lines += _rule_rows(RULES)
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
