"""The human form of a :class:`~longboat.plan.planner.Plan`: a table and a recommendation."""

from __future__ import annotations

import io

from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from longboat.plan.planner import Plan
from longboat.plan.target import PlanInputError

_MIB = 2**20


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512MiB``, ``2.5GB`` or a plain number of bytes, as bytes."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise PlanInputError(
            f"--budget {text!r} is not a size; write e.g. 8GiB, 512MiB or 2.5GB"
        ) from None


def _mib(n: int) -> str:
    return f"{n / _MIB:,.1f}"


def render(plan: Plan, width: int = 120) -> str:
    """The plan as text: one row per strategy, then the recommendation."""
    title = (
        f"{plan.model}: {plan.trainable_params:,} trainable parameters, micro-batch "
        f"{plan.micro_batch}, {plan.world_size} rank(s), {plan.precision}, "
        f"{plan.optimizer}; MiB per rank"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "strategy",
        "parameters",
        "gradients",
        "optimizer",
        "comm buffers",
        "activations",
        "transient",
        "peak",
        "fits",
        "comm/step",
    ):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right")
    for s in plan.strategies:
        fits = "-" if s.fits is None else ("yes" if s.fits else "NO")
        ms = s.model_state
        table.add_row(
            s.strategy,
            _mib(ms["parameters"]),
            _mib(ms["gradients"]),
            _mib(ms["optimizer_state"]),
            _mib(ms["communication_buffers"]),
            _mib(s.activations),
            _mib(s.transient),
            _mib(s.peak),
            fits,
            _mib(s.comm_total),
        )
    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, highlight=False)
    console.print(table)
    lines = [buf.getvalue().rstrip()]
    if plan.budget is not None:
        lines.append(f"budget: {_mib(plan.budget)} MiB per rank")
        over = [s.strategy for s in plan.strategies if s.fits is False]
        if over:
            lines.append(f"do not fit: {', '.join(over)}")
    lines.append("communication per step and rank (bytes sent, ring algorithms):")
    for s in plan.strategies:
        parts = ", ".join(f"{op} {_mib(b)} MiB" for op, b in sorted(s.comm_bytes.items()))
        lines.append(f"  {s.strategy:<10} {parts or 'none'}")
    if plan.recommended:
        lines.append(f"recommended: {plan.recommended} ({plan.reason})")
    else:
        lines.append(f"recommended: none ({plan.reason})")
    return "\n".join(lines)
