"""``longboat doctor``: the preflight (the checks are in :mod:`longboat.launch.doctor`)."""

from __future__ import annotations

from pathlib import Path

import typer

from longboat.cli import hostopts, options
from longboat.cli.app import app, usage_error


@app.command("doctor")
def doctor_command(
    nproc_per_node: int = options.NPROC_PER_NODE,
    nnodes: int = options.NNODES,
    node_rank: int = options.NODE_RANK,
    master_addr: str = options.MASTER_ADDR,
    master_port: int | None = options.MASTER_PORT,
    config: Path | None = options.config_file(
        "check this config's batch arithmetic for the world size"
    ),
    backend: str | None = typer.Option(
        None, "--backend", help="gloo, nccl or mpi (default: nccl with CUDA, else gloo)"
    ),
    rdzv_timeout: int = typer.Option(
        60, "--rdzv-timeout", help="seconds to wait for all ranks and nodes to join"
    ),
    hostfile: Path | None = hostopts.HOSTFILE,
    host_list: str | None = hostopts.HOSTS,
    include: str | None = hostopts.INCLUDE,
    exclude: str | None = hostopts.EXCLUDE,
    remote_shell: str = hostopts.REMOTE_SHELL,
    ssh_port: int | None = hostopts.SSH_PORT,
    ssh_option: list[str] | None = hostopts.SSH_OPTION,
) -> None:
    """Check that a job can run here (versions, backend, network, shared memory, config);
    each problem comes with its fix. Exit 0 only when no check fails. With --hostfile or -H:
    the hosts, their ranks, interfaces and device links, as `longboat run` would use them."""
    from longboat.launch.doctor import DoctorOptions, doctor
    from longboat.launch.run import LaunchUsageError

    on = hostopts.hosts_and_shell(
        hostfile, host_list, include, exclude, remote_shell, ssh_port, ssh_option
    )
    if on is not None:
        from longboat.launch.doctor.topology import doctor_hosts

        raise typer.Exit(doctor_hosts(*on, port=master_port or 29500))

    opts = DoctorOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        config=config,
        backend=backend,
        timeout_s=rdzv_timeout,
    )
    try:
        code = doctor(opts)
    except LaunchUsageError as e:
        raise usage_error(str(e)) from None
    raise typer.Exit(code)
