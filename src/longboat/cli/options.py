"""Options that several commands take, defined once so that they read and default alike."""

from __future__ import annotations

from pathlib import Path

import typer

NPROC_PER_NODE = typer.Option(
    1, "-n", "--nproc-per-node", help="ranks (worker processes) on this node"
)
RUN_NPROC = typer.Option(
    "1",
    "-n",
    "--nproc-per-node",
    help="ranks (worker processes) on this node: a number; gpu, cpu or auto (torchrun's); or "
    "MIN:MAX, an elastic node that restarts without failed workers' slots, down to MIN",
)
NNODES = typer.Option(1, "--nnodes", help="number of nodes in the job")
NODE_RANK = typer.Option(0, "--node-rank", help="this node's rank, 0 to nnodes-1")
MASTER_ADDR = typer.Option(
    "127.0.0.1", "--master-addr", help="address of node 0, which hosts the rendezvous"
)
MASTER_PORT = typer.Option(
    None, "--master-port", help="port on node 0 (default: a free port; single node only)"
)
# `longboat run`'s node options default to None: what the user left out is read from Slurm or a
# PyTorchJob (longboat.launch.node_env), and only then falls back to one local node.
_DETECTED = "read from srun or a PyTorchJob"
RUN_NNODES = typer.Option(
    None, "--nnodes", help=f"number of nodes in the job (default: {_DETECTED}, else 1)"
)
RUN_NODE_RANK = typer.Option(
    None, "--node-rank", help=f"this node's rank, 0 to nnodes-1 (default: {_DETECTED}, else 0)"
)
RUN_MASTER_ADDR = typer.Option(
    None,
    "--master-addr",
    help=f"address of node 0, which hosts the rendezvous (default: {_DETECTED}, else 127.0.0.1)",
)
RUN_MASTER_PORT = typer.Option(
    None,
    "--master-port",
    help=f"port on node 0 (default: {_DETECTED}, else a free port; single node only)",
)
MICRO_BATCH = typer.Option(8, "--micro-batch", help="samples per rank per forward")
MODEL = typer.Option(
    "reference-gpt",
    "--model",
    help="reference-gpt, digits-cnn, tiny-gpt, gpt (plan) or package.module:factory",
)


def config_file(help: str) -> Path | None:
    """A ``--config FILE`` option (what the file is used for differs per command)."""
    # typer.Option stands in for the parameter's default, typed as the value it will give.
    option: Path | None = typer.Option(None, "--config", help=help)
    return option
