"""``longboat tune``: the fastest configuration that fits a memory budget, found by the planner
and confirmed by measurement (the work is in :mod:`longboat.tune`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from longboat.cli.app import app, usage_error


@app.command()
def tune(
    script: Path | None = typer.Argument(
        None,
        metavar="SCRIPT",
        help="a training script to tune instead of --model: each candidate is a run of it "
        "(longboat run -n WORLD_SIZE SCRIPT ARGS) for --warmup + --steps steps",
    ),
    script_args: list[str] | None = typer.Argument(
        None, metavar="-- ARGS", help="arguments for the script, after --"
    ),
    model: str = typer.Option(
        "reference-gpt",
        "--model",
        help="reference-gpt, digits-cnn, tiny-gpt or package.module:factory returning a "
        "longboat.bench.ModelSpec (as longboat bench takes it)",
    ),
    world_size: int = typer.Option(2, "--world-size", help="number of ranks"),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="memory per rank as longboat plan counts it (live tensors), e.g. 400MiB; "
        "candidates over it are never launched",
    ),
    global_batch: int | None = typer.Option(
        None, "--global-batch", help="samples per optimizer step (default: 8 per rank)"
    ),
    time: str = typer.Option("10m", "--time", help="time for the whole search, e.g. 10m, 90s"),
    top: str = typer.Option(
        "3",
        "--top",
        help="how many of the best-predicted to measure, or all: every candidate that fits, "
        "and whether the choice of the default --top 3 is the fastest of them",
    ),
    out: Path = typer.Option(
        Path("tuned.toml"),
        "--out",
        help="the chosen longboat config; the DeepSpeed JSON goes beside it "
        "(tuned.deepspeed.json) where DeepSpeed's keys can say it",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    seq_len: int = typer.Option(128, "--seq-len", help="tokens per sequence (GPT models)"),
    warmup: int = typer.Option(1, "--warmup", help="unmeasured steps per measured candidate"),
    steps: int = typer.Option(5, "--steps", help="measured steps per measured candidate"),
    micro_batches: str | None = typer.Option(
        None,
        "--micro-batches",
        help="micro-batch sizes to try, e.g. 1,2,4 (default: powers of two up to a rank's "
        "share of the global batch, and the share)",
    ),
    bucket_mb: str = typer.Option(
        "25,5", "--bucket-mb", help="gradient bucket sizes to try (replicate, ZeRO-1/2), MiB"
    ),
    recompute: bool = typer.Option(
        True,
        "--recompute/--no-recompute",
        help="also try recomputing the model's blocks in backward (activation checkpointing)",
    ),
    comm_dtypes: str = typer.Option(
        "fp32",
        "--comm-dtypes",
        help="dtypes gradients may travel in, e.g. fp32,bf16 (bf16 changes the arithmetic)",
    ),
    precisions: str = typer.Option(
        "auto",
        "--precisions",
        help="precisions to try, from fp32, bf16 (autocast) and bf16-params (bf16 parameters, "
        "fp32 masters: ZeRO-3); auto: all three where CUDA computes in bf16, else fp32 (a CPU "
        "without bf16 matrix units runs bf16 slower)",
    ),
    offload_dir: Path | None = typer.Option(
        None, "--offload-dir", help="also try ZeRO-3 with its state on disk in this directory"
    ),
    pp: str = typer.Option(
        "auto",
        "--pp",
        help="pipeline stages to try, e.g. 1,2; auto: 1 and every divisor of the world size "
        "where the model lists its layers",
    ),
    tp: str = typer.Option(
        "auto",
        "--tp",
        help="tensor-parallel ranks to try, e.g. 1,2; auto: 1 and every divisor of the world "
        "size where a tensor-parallel plan names the model",
    ),
    schedules: str = typer.Option(
        "1f1b,zb-h1", "--schedules", help="pipeline schedules to try, with --pp above 1"
    ),
    plan_model: str | None = typer.Option(
        None,
        "--plan-model",
        help="with a script: package.module:callable building its model, in a module with "
        "example_input(model, micro_batch) (the script's directory is searched first); "
        "without it a script is measured, not planned",
    ),
    noise_band: float = typer.Option(
        0.05,
        "--noise-band",
        help="with --top all: how much faster in paired rounds (a fraction) a candidate must be "
        "to count as faster than the default's choice",
    ),
) -> None:
    """Find the fastest configuration whose planned memory fits the budget, and write it: of a
    bench model (--model), or of your own script (longboat tune train.py -- ARGS)."""
    from longboat.bench.runner import BenchError
    from longboat.tune.command import Flags, TuneUsageError, run

    flags = Flags(
        model=model,
        world_size=world_size,
        budget=budget,
        global_batch=global_batch,
        time=time,
        top=top,
        seq_len=seq_len,
        warmup=warmup,
        steps=steps,
        micro_batches=micro_batches,
        bucket_mb=bucket_mb,
        recompute=recompute,
        comm_dtypes=comm_dtypes,
        precisions=precisions,
        offload_dir=offload_dir,
        noise_band=noise_band,
        pp=pp,
        tp=tp,
        schedules=schedules,
        script=script,
        script_args=tuple(script_args or ()),
        plan_model=plan_model,
    )
    try:
        text, code, _ = run(flags, out, as_json)
    except TuneUsageError as e:
        raise usage_error(str(e)) from None
    except BenchError as e:
        print(f"longboat: tune failed while measuring: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None
    print(text)
    raise typer.Exit(code)
