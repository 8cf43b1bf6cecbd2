"""``longboat plan``: memory and communication per rank, before the hardware (the work is in
:mod:`longboat.plan`)."""

from __future__ import annotations

from pathlib import Path

import typer

from longboat.cli import options
from longboat.cli.app import app, usage_error


@app.command("plan")
def plan(
    model: str = options.MODEL,
    model_args: str | None = typer.Option(
        None,
        "--model-args",
        help="JSON keyword arguments for the model, e.g. '{\"d_model\": 1024}'",
    ),
    micro_batch: int | None = typer.Option(
        None,
        "--micro-batch",
        help="samples per rank per forward (default: the config's batch.micro_batch_size, else 8)",
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="tokens per sample for GPT models (default: the model's)"
    ),
    world_size: int = typer.Option(2, "--world-size", help="number of ranks"),
    precision: str | None = typer.Option(
        None, "--precision", help="fp32, bf16 or fp16 (default: the config's, else fp32)"
    ),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam, sgd or sgd-momentum"),
    budget: str | None = typer.Option(
        None, "--budget", help="memory per rank, e.g. 8GiB; exit 1 if no strategy fits"
    ),
    strategies: str | None = typer.Option(
        None,
        "--strategies",
        help="comma-separated, from single,replicate,zero-1,zero-2,zero-3 (the default) and "
        "parameter_server (planned by default when it is the config's strategy)",
    ),
    config_file: Path | None = options.config_file(
        "a longboat config: bucket sizes, ZeRO units, precision"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    pp: int | None = typer.Option(
        None, "--pp", help="pipeline stages (mesh.pp; default: the config's, else 1)"
    ),
    micro_batches: int | None = typer.Option(
        None,
        "--micro-batches",
        help="micro-batches per optimizer step: gradient accumulation, or with --pp the "
        "schedule's (default: from the config's batch triple at this world size, else 1; "
        "with --pp, else the number of stages)",
    ),
    schedule: str | None = typer.Option(
        None,
        "--schedule",
        help="gpipe, 1f1b, interleaved, zb-h1 or interleaved-zb (default: the config's, else 1f1b)",
    ),
    virtual_stages: int | None = typer.Option(
        None,
        "--virtual-stages",
        help="stages per rank with --schedule interleaved or interleaved-zb",
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="tensor-parallel ranks (mesh.tp; default: the config's, else 1)"
    ),
    sequence_parallel: bool | None = typer.Option(
        None,
        "--sequence-parallel/--no-sequence-parallel",
        help="with --tp: divide activations along the sequence (default: the config's)",
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        help="cpu or cuda: the device the peaks are for; cuda adds cuBLAS's workspaces "
        "(default: cuda where torch sees a GPU, else cpu)",
    ),
) -> None:
    """Predict per-rank memory and communication of each strategy, allocating nothing."""
    from longboat.config.errors import ConfigError
    from longboat.plan.run_cli import run_plan
    from longboat.plan.target import PlanInputError

    if precision is not None and precision not in ("fp32", "bf16", "fp16"):
        raise usage_error(f"--precision {precision!r} is invalid: use fp32, bf16 or fp16")
    try:
        text, code = run_plan(
            model,
            model_args,
            micro_batch,
            seq_len,
            world_size,
            precision,
            optimizer,
            budget,
            strategies,
            config_file,
            as_json,
            pp=pp,
            micro_batches=micro_batches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            tp=tp,
            sequence_parallel=sequence_parallel,
            device=device,
        )
    except (PlanInputError, ConfigError) as e:
        raise usage_error(str(e)) from None
    print(text)
    raise typer.Exit(code)
