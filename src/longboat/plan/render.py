"""The human form of a :class:`~longboat.plan.planner.Plan`: a table and a recommendation."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from longboat.plan.target import PlanInputError

if TYPE_CHECKING:  # the planner is not needed to render its plan
    from longboat.plan.planner import Plan, StrategyPlan

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


def _per_layer(layers: dict[str, int]) -> str:
    """Layers alike but for their index (``blocks.0.attn.qkv``, ``blocks.1.attn.qkv``) on one
    entry: ``blocks.*.attn.qkv 4 x 2.0 MiB``."""
    groups: dict[str, list[int]] = {}
    for name, b in layers.items():
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        groups.setdefault(key, []).append(b)
    out = []
    for key, sizes in groups.items():
        if len(sizes) == 1:
            out.append(f"{key} {_mib(sizes[0])} MiB")
        elif len(set(sizes)) == 1:
            out.append(f"{key} {len(sizes)} x {_mib(sizes[0])} MiB")
        else:
            out.append(f"{key} {len(sizes)} layers, {_mib(sum(sizes))} MiB in all")
    return ", ".join(out)


def _label(s: StrategyPlan) -> str:
    return f"{s.strategy} {s.role}" if s.role else s.strategy


def _row_name(s: StrategyPlan) -> str:
    if not s.stages:
        return _label(s)
    return f"{s.strategy} stage {','.join(map(str, s.stages))}"


def _pipeline_line(plan: Plan) -> str:
    p = plan.pipeline or {}
    staged = [s for s in plan.strategies if s.stages]
    held = ", ".join(
        f"stage {','.join(map(str, s.stages))} {s.in_flight}"
        for s in staged
        if s.strategy == staged[-1].strategy
    )
    virtual = f" x {p['virtual_stages']} virtual stages" if p["virtual_stages"] > 1 else ""
    line = (
        f"pipeline: {p['pp']} stage rank(s){virtual} x {p['dp']} data-parallel, {p['schedule']}, "
        f"{p['micro_batches']} micro-batches of {plan.micro_batch} per step: idle fraction "
        f"{100 * p['idle_fraction']:.0f}% with equal stages"
    )
    if not held:  # no strategy's stages could be planned
        return line
    return (
        f"{line}; micro-batches' activations held at most: {held}; 'send' is the activations "
        "and gradients to the neighbouring stages"
    )


def _unplanned(plan: Plan) -> list[str]:
    """One line per reason a strategy could not be planned, naming the strategies it holds
    back ([Note: unplanned rows] in ``planner.py``)."""
    why: dict[str, list[str]] = {}
    for s in plan.strategies:
        if s.error:
            why.setdefault(s.error, []).append(_label(s))
    return [f"not planned: {', '.join(names)}: {error}" for error, names in why.items()]


def _per_step(plan: Plan) -> str:
    if plan.accumulation == 1 or plan.pipeline:  # a pipeline's line says its micro-batches
        return ""
    return f" x {plan.accumulation} per step (accumulation)"


def render(plan: Plan, width: int = 120) -> str:
    """The plan as text: one row per strategy, then the recommendation."""
    title = (
        f"{plan.model}: {plan.trainable_params:,} trainable parameters, micro-batch "
        f"{plan.micro_batch}{_per_step(plan)}, {plan.world_size} rank(s), {plan.precision}, "
        f"{plan.optimizer}; MiB per rank"
    )
    table = Table(title=title, title_justify="left")
    staged = any(s.stages for s in plan.strategies)
    roled = any(s.role for s in plan.strategies)  # [Note: planning roles] in planner.py
    table.add_column("strategy", justify="left", no_wrap=True)
    if staged:
        table.add_column("stage", justify="right")
    if roled:
        table.add_column("role", justify="left")
    for col in (
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
        table.add_column(col, justify="right" if col != "fits" else "left")
    for s in plan.strategies:
        fits = "-" if s.fits is None else ("yes" if s.fits else "NO")
        ms = s.model_state
        first = [s.strategy]
        if staged:
            first.append(",".join(map(str, s.stages)) or "-")
        if roled:
            first.append(s.role or "-")
        figures = [
            _mib(ms["parameters"]),
            _mib(ms["gradients"]),
            _mib(ms["optimizer_state"]),
            _mib(ms["communication_buffers"]),
            _mib(s.activations),
            _mib(s.transient),
            _mib(s.peak),
            fits,
            _mib(s.comm_total),
        ]
        if s.error:  # [Note: unplanned rows]: the reason follows the table
            figures = ["-"] * (len(figures) - 2) + ["n/a", "-"]
        table.add_row(*first, *figures)
    buf = io.StringIO()
    # The role column and a long strategy name need room the figures would otherwise lose.
    # Markup and emoji codes off: the title holds the user's model name, and
    # "hfmodels:llama" is not meant as ":llama:" (an emoji) nor "[x]" as a style.
    console = Console(
        file=buf,
        width=width + 24 * roled,
        no_color=True,
        highlight=False,
        markup=False,
        emoji=False,
    )
    console.print(table)
    lines = [buf.getvalue().rstrip()]
    lines += _unplanned(plan)
    spaces = next((s.workspaces for s in plan.strategies if s.workspaces), 0)
    if spaces:  # [Note: library workspaces] in device.py
        lines.append(
            f"on {plan.device}: transient and peak include {_mib(spaces)} MiB of {plan.workspaces}"
        )
    hosted = [f"{_row_name(s)} {_mib(s.host)} MiB" for s in plan.strategies if s.host]
    if hosted:  # ZeRO-Offload beside a GPU ([Note: planning host offload] in placement.py)
        lines.append(
            "host memory per rank, at most (optimizer state, masters and gradient copies; at "
            f"stage 3 the parameters' only copy): {', '.join(hosted)}"
        )
    if plan.pipeline:
        lines.append(_pipeline_line(plan))
    if plan.budget is not None:
        lines.append(f"budget: {_mib(plan.budget)} MiB per rank")
        over = list(dict.fromkeys(s.strategy for s in plan.strategies if s.fits is False))
        if over:
            lines.append(f"do not fit: {', '.join(over)}")
    lines.append(
        "communication per step and rank (bytes sent, ring algorithms; what a rank receives "
        "where a row says so):"
    )
    for s in plan.strategies:
        parts = ", ".join(f"{op} {_mib(b)} MiB" for op, b in sorted(s.comm_bytes.items()))
        lines.append(f"  {_row_name(s):<25} {'not planned' if s.error else parts or 'none'}")
    for s in plan.strategies:
        if s.disk:
            lines.append(
                f"  {_row_name(s):<25} model state on disk: {_mib(s.disk)} MiB, read and "
                f"written per step: {_mib(s.disk_moved)} MiB"
            )
    layered = next((s for s in plan.strategies if s.tp_layers), None)
    if layered is not None:
        lines.append(
            "tensor-parallel layers, bytes sent per step and rank (the same under each "
            f"strategy): {_per_layer(layered.tp_layers)}"
        )
    if plan.recommended:
        lines.append(f"recommended: {plan.recommended} ({plan.reason})")
    else:
        lines.append(f"recommended: none ({plan.reason})")
    return "\n".join(lines)
