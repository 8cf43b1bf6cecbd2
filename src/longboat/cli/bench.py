"""``longboat bench``: strategies and peers side by side (the work is in :mod:`longboat.bench`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from longboat.cli import options
from longboat.cli.app import app, usage_error


@app.command()
def bench(
    model: str = options.MODEL,
    strategies: str = typer.Option(
        "single,replicate,zero1,zero2,zero3",
        "--strategies",
        help="longboat strategies, comma-separated (also: pipeline, one stage per rank; "
        "tensor-parallel, layers divided over every rank; parameter_server, the last rank "
        "serving)",
    ),
    peers: str = typer.Option(
        "ddp,fsdp2,deepspeed", "--peers", help="peers to compare, comma-separated ('' for none)"
    ),
    world_sizes: str = typer.Option("1,2", "--world-sizes", help="e.g. 1,2,4"),
    micro_batch: int = options.MICRO_BATCH,
    seq_len: int = typer.Option(128, "--seq-len", help="tokens per sequence (GPT models)"),
    warmup: int = typer.Option(2, "--warmup", help="unmeasured steps per side"),
    steps: int = typer.Option(10, "--steps", help="measured steps per side"),
    scaling: str = typer.Option(
        "weak", "--scaling", help="weak: same micro-batch per rank; strong: same global batch"
    ),
    threads: int = typer.Option(1, "--threads", help="torch threads per rank"),
    memory: bool = typer.Option(
        True, "--memory/--no-memory", help="also run each side alone for its peak RSS"
    ),
    pipeline_micro_batches: int = typer.Option(
        4, "--pipeline-micro-batches", help="micro-batches per step of the pipeline side"
    ),
    out: Path = typer.Option(Path("bench-results"), "--out", help="directory for the outputs"),
) -> None:
    """Measure step time, throughput, scaling and memory of strategies and peers."""
    from longboat.bench.command import BenchUsageError, settings_from_flags
    from longboat.bench.command import bench as run_bench
    from longboat.bench.runner import BenchError

    try:
        settings = settings_from_flags(
            model=model,
            strategies=strategies,
            peers=peers,
            world_sizes=world_sizes,
            micro_batch=micro_batch,
            seq_len=seq_len,
            warmup=warmup,
            steps=steps,
            scaling=scaling,
            threads=threads,
            memory=memory,
            pipeline_micro_batches=pipeline_micro_batches,
        )
        run_bench(settings, out)
    except BenchUsageError as e:
        raise usage_error(str(e)) from None
    except BenchError as e:
        print(f"longboat: bench failed: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None
