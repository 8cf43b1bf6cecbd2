"""The ``longboat`` command line. It only parses; the work is in :mod:`longboat.launch.run`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from longboat.launch.run import RunOptions

app = typer.Typer(
    name="longboat",
    help="Distributed PyTorch training by configuration.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect a longboat configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
checkpoint_app = typer.Typer(help="Inspect or consolidate a longboat checkpoint.",
                             no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")

USAGE_EXIT = 2


def _usage_error(message: str) -> typer.Exit:
    print(f"longboat: error: {message}", file=sys.stderr, flush=True)
    return typer.Exit(USAGE_EXIT)


@app.command(
    # Everything after the script belongs to the script, dashes included.
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run(
    script: Path = typer.Argument(
        ..., metavar="SCRIPT", help="the training script, run as `python -u SCRIPT ARGS...`"
    ),
    script_args: list[str] | None = typer.Argument(
        None, metavar="ARGS", help="arguments for the script, passed as given"
    ),
    nproc_per_node: int = typer.Option(
        1, "-n", "--nproc-per-node", help="worker processes on this node"
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="number of nodes in the job"),
    node_rank: int = typer.Option(0, "--node-rank", help="this node's rank, 0 to nnodes-1"),
    master_addr: str = typer.Option(
        "127.0.0.1", "--master-addr", help="address of node 0, which hosts the rendezvous"
    ),
    master_port: int | None = typer.Option(
        None, "--master-port", help="port on node 0 (default: a free port; single node only)"
    ),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="restart all workers up to this many times after a failure"
    ),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="keep each rank's stdout/stderr under this directory"
    ),
    rdzv_timeout: int = typer.Option(
        900, "--rdzv-timeout", help="seconds to wait for all nodes to join"
    ),
    grace_period: int = typer.Option(
        30, "--grace-period", help="on SIGTERM/SIGINT, seconds the workers get to finish "
        "(e.g. write a final checkpoint) before they are killed"
    ),
    doctor: bool = typer.Option(
        False, "--doctor", help="run `longboat doctor` with these options first; start SCRIPT "
        "only if no check fails"
    ),
) -> None:
    """Run SCRIPT on N processes per node (a drop-in for torchrun)."""
    from longboat.launch.run import LaunchUsageError, RunOptions, launch, validate

    opts = RunOptions(
        script=script,
        script_args=tuple(script_args or ()),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        log_dir=log_dir,
        rdzv_timeout_s=rdzv_timeout,
        grace_period_s=grace_period,
    )
    try:
        if doctor:
            validate(opts)  # usage errors first, before any check runs
            _preflight(opts)
        code = launch(opts)
    except LaunchUsageError as e:
        raise _usage_error(str(e)) from None
    raise typer.Exit(code)


def _preflight(opts: RunOptions) -> None:
    """``run --doctor``: the doctor's checks for this run; exit 1 without starting on failure."""
    from longboat.launch.doctor import DoctorOptions, doctor

    code = doctor(DoctorOptions(
        nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes, node_rank=opts.node_rank,
        master_addr=opts.master_addr, master_port=opts.master_port,
        timeout_s=min(opts.rdzv_timeout_s, 60)))
    if code != 0:
        print(f"longboat: not starting {opts.script}: fix the problems above (or drop --doctor)",
              file=sys.stderr, flush=True)
        raise typer.Exit(code)


@app.command("doctor")
def doctor_command(
    nproc_per_node: int = typer.Option(1, "-n", "--nproc-per-node", help="ranks on this node"),
    nnodes: int = typer.Option(1, "--nnodes", help="number of nodes in the job"),
    node_rank: int = typer.Option(0, "--node-rank", help="this node's rank, 0 to nnodes-1"),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", help="address of node 0"),
    master_port: int | None = typer.Option(
        None, "--master-port", help="port on node 0 (default: a free port; single node only)"),
    config: Path | None = typer.Option(
        None, "--config", help="check this config's batch arithmetic for the world size"),
    backend: str | None = typer.Option(
        None, "--backend", help="gloo, nccl or mpi (default: nccl with CUDA, else gloo)"),
    rdzv_timeout: int = typer.Option(
        60, "--rdzv-timeout", help="seconds to wait for all ranks and nodes to join"),
) -> None:
    """Check that a job can run here (versions, backend, network, shared memory, config);
    each problem comes with its fix. Exit 0 only when no check fails."""
    from longboat.launch.doctor import DoctorOptions, doctor
    from longboat.launch.run import LaunchUsageError

    opts = DoctorOptions(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                         master_addr=master_addr, master_port=master_port, config=config,
                         backend=backend, timeout_s=rdzv_timeout)
    try:
        code = doctor(opts)
    except LaunchUsageError as e:
        raise _usage_error(str(e)) from None
    raise typer.Exit(code)


@config_app.command("explain")
def config_explain(
    file: Path = typer.Argument(
        ..., metavar="FILE", help="a longboat TOML/JSON/YAML or DeepSpeed JSON config"
    ),
    world_size: int = typer.Option(1, "--world-size", help="number of ranks to explain it for"),
) -> None:
    """Show the resolved configuration and how derived values (the batch triple) follow."""
    from longboat import config

    if not file.is_file():
        raise _usage_error(f"config file {str(file)!r} does not exist: give the path of a file")
    if world_size < 1:
        raise _usage_error(f"--world-size {world_size} is invalid: use 1 or more")
    try:
        text = config.explain(file, world_size)
    except config.ConfigError as e:
        raise _usage_error(str(e)) from None
    print(text)


@checkpoint_app.command("inspect")
def checkpoint_inspect(
    directory: Path = typer.Argument(
        ..., metavar="DIR", help="a checkpoint (tag directory), or a directory of checkpoints "
        "(its latest is shown)"),
) -> None:
    """Show what a checkpoint holds and whether every file matches its SHA-256 (exit 1 if not)."""
    from longboat.checkpoint import CheckpointNotFoundError
    from longboat.checkpoint.inspect import describe

    if not directory.is_dir():
        raise _usage_error(f"checkpoint directory {str(directory)!r} does not exist: give the "
                           "directory save_checkpoint wrote, or one of its tag directories")
    try:
        found = describe(directory)
    except CheckpointNotFoundError as e:
        raise _usage_error(str(e)) from None
    print(found.text)
    raise typer.Exit(0 if found.verified else 1)


@checkpoint_app.command("consolidate")
def checkpoint_consolidate(
    directory: Path = typer.Argument(
        ..., metavar="DIR", help="a checkpoint (tag directory), or a directory of checkpoints "
        "(its latest is used)"),
    out: Path = typer.Argument(..., metavar="OUT.safetensors", help="the file to write"),
) -> None:
    """Write the model's full weights as one plain safetensors file (model.load_state_dict
    accepts it after safetensors.torch.load_file; nothing of longboat is needed to read it)."""
    from longboat.checkpoint import CheckpointError, CheckpointNotFoundError
    from longboat.checkpoint.inspect import consolidate

    if not directory.is_dir():
        raise _usage_error(f"checkpoint directory {str(directory)!r} does not exist: give the "
                           "directory save_checkpoint wrote, or one of its tag directories")
    if out.suffix != ".safetensors":
        raise _usage_error(f"output {str(out)!r} must end in .safetensors, e.g. model.safetensors")
    if not out.parent.is_dir():
        raise _usage_error(f"output directory {str(out.parent)!r} does not exist: create it "
                           "first")
    try:
        written = consolidate(directory, out)
    except CheckpointNotFoundError as e:
        raise _usage_error(str(e)) from None
    except CheckpointError as e:
        print(f"longboat: error: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None
    print(f"wrote {written} ({written.stat().st_size:,} bytes)")


@app.command()
def bench(
    model: str = typer.Option("reference-gpt", "--model",
                              help="reference-gpt, digits-cnn, tiny-gpt or pkg.module:factory"),
    strategies: str = typer.Option("single,replicate,zero1,zero2,zero3", "--strategies",
                                   help="longboat strategies, comma-separated"),
    peers: str = typer.Option("ddp,fsdp2,deepspeed", "--peers",
                              help="peers to compare, comma-separated ('' for none)"),
    world_sizes: str = typer.Option("1,2", "--world-sizes", help="e.g. 1,2,4"),
    micro_batch: int = typer.Option(8, "--micro-batch", help="samples per rank per step"),
    seq_len: int = typer.Option(128, "--seq-len", help="tokens per sequence (GPT models)"),
    warmup: int = typer.Option(2, "--warmup", help="unmeasured steps per side"),
    steps: int = typer.Option(10, "--steps", help="measured steps per side"),
    scaling: str = typer.Option("weak", "--scaling",
                                help="weak: same micro-batch per rank; strong: same global batch"),
    threads: int = typer.Option(1, "--threads", help="torch threads per rank"),
    memory: bool = typer.Option(True, "--memory/--no-memory",
                                help="also run each side alone for its peak RSS"),
    out: Path = typer.Option(Path("bench-results"), "--out", help="directory for the outputs"),
) -> None:
    """Measure step time, throughput, scaling and memory of strategies and peers."""
    from longboat.bench.command import BenchUsageError, settings_from_flags
    from longboat.bench.command import bench as run_bench
    from longboat.bench.runner import BenchError

    try:
        settings = settings_from_flags(
            model=model, strategies=strategies, peers=peers, world_sizes=world_sizes,
            micro_batch=micro_batch, seq_len=seq_len, warmup=warmup, steps=steps,
            scaling=scaling, threads=threads, memory=memory)
        run_bench(settings, out)
    except BenchUsageError as e:
        raise _usage_error(str(e)) from None
    except BenchError as e:
        print(f"longboat: bench failed: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None


@app.command("plan")
def plan(
    model: str = typer.Option(
        "reference-gpt", "--model", help="reference-gpt, gpt, digits-cnn or "
        "package.module:callable (its module defines example_input(model, micro_batch))"),
    model_args: str | None = typer.Option(
        None, "--model-args",
        help='JSON keyword arguments for the model, e.g. \'{"d_model": 1024}\''),
    micro_batch: int = typer.Option(8, "--micro-batch", help="samples per rank per forward"),
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="tokens per sample for GPT models (default: the model's)"),
    world_size: int = typer.Option(2, "--world-size", help="number of ranks"),
    precision: str | None = typer.Option(
        None, "--precision", help="fp32, bf16 or fp16 (default: the config's, else fp32)"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adam, sgd or sgd-momentum"),
    budget: str | None = typer.Option(
        None, "--budget", help="memory per rank, e.g. 8GiB; exit 1 if no strategy fits"),
    strategies: str | None = typer.Option(
        None, "--strategies", help="comma-separated, from single,replicate,zero-1,zero-2,zero-3"),
    config_file: Path | None = typer.Option(
        None, "--config", help="a longboat config: bucket sizes, ZeRO units, precision"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
) -> None:
    """Predict per-rank memory and communication of each strategy, allocating nothing."""
    from longboat.config import ConfigError
    from longboat.plan.run_cli import run_plan
    from longboat.plan.target import PlanInputError

    if precision is not None and precision not in ("fp32", "bf16", "fp16"):
        raise _usage_error(f"--precision {precision!r} is invalid: use fp32, bf16 or fp16")
    try:
        text, code = run_plan(model, model_args, micro_batch, seq_len, world_size, precision,
                              optimizer, budget, strategies, config_file, as_json)
    except (PlanInputError, ConfigError) as e:
        raise _usage_error(str(e)) from None
    print(text)
    raise typer.Exit(code)


def main() -> None:
    """Console entry point ``longboat``."""
    app()


if __name__ == "__main__":
    main()
