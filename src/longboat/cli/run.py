"""``longboat run``: start a script on N processes per node (the work is in
:mod:`longboat.launch.run`)."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from longboat.cli import hostopts, options
from longboat.cli.app import app, usage_error

if TYPE_CHECKING:
    from longboat.launch.hosts import Host
    from longboat.launch.run import RunOptions
    from longboat.launch.shells import RemoteShell


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
    nproc: str = options.RUN_NPROC,
    nnodes_text: str | None = options.RUN_NNODES,
    node_rank: int | None = options.RUN_NODE_RANK,
    master_addr: str | None = options.RUN_MASTER_ADDR,
    master_port: int | None = options.RUN_MASTER_PORT,
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="restart all workers up to this many times after a failure"
    ),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="keep each rank's stdout/stderr under this directory"
    ),
    rdzv_timeout: int = typer.Option(
        900, "--rdzv-timeout", help="seconds to wait for all nodes to join"
    ),
    rdzv_id: str | None = typer.Option(
        None,
        "--rdzv-id",
        help="the job's id (TORCHELASTIC_RUN_ID), as torchrun's flag; default: a fresh one per "
        "single-node run, 'none' across nodes (give every node the same)",
    ),
    grace_period: int = typer.Option(
        30,
        "--grace-period",
        help="on SIGTERM/SIGINT, seconds the workers get to finish "
        "(e.g. write a final checkpoint) before they are killed",
    ),
    local_ranks_filter: str | None = typer.Option(
        None,
        "--local-ranks-filter",
        help="show only these local ranks' output, e.g. 0 or 0,2 (torchrun's flag); every "
        "rank's output is still kept for failure reports",
    ),
    rank_prefix: bool = typer.Option(
        True,
        "--rank-prefix/--no-rank-prefix",
        help="put [rankN]: before each worker output line (off for scripts that parse their "
        "own output)",
    ),
    standalone: bool = typer.Option(
        False,
        "--standalone",
        help="torchrun's single-node mode: what longboat run does by default (a free port on "
        "this host); accepted for torchrun command lines",
    ),
    doctor: bool = typer.Option(
        False,
        "--doctor",
        help="run `longboat doctor` with these options first; start SCRIPT only if no check fails",
    ),
    hostfile: Path | None = hostopts.HOSTFILE,
    host_list: str | None = hostopts.HOSTS,
    include: str | None = hostopts.INCLUDE,
    exclude: str | None = hostopts.EXCLUDE,
    remote_shell: str = hostopts.REMOTE_SHELL,
    ssh_port: int | None = hostopts.SSH_PORT,
    ssh_option: list[str] | None = hostopts.SSH_OPTION,
    no_ssh: bool = typer.Option(
        False,
        "--no-ssh",
        help="with --hostfile/-H: start only this host's node (run the same command on every "
        "host, e.g. one pod each); its node rank is --node-rank, or its place in the list",
    ),
    stop_on_eof: bool = typer.Option(
        False, "--stop-on-eof", hidden=True, help="stop as on SIGTERM when stdin closes"
    ),
) -> None:
    """Run SCRIPT on N processes per node (a drop-in for torchrun)."""
    from longboat.launch import nproc as nproc_values
    from longboat.launch.run import LaunchUsageError, RunOptions, launch, validate

    try:
        workers = nproc_values.parse(nproc)
    except nproc_values.NprocError as e:
        raise usage_error(str(e)) from None
    nproc_per_node = workers.most
    nnodes = _nnodes(nnodes_text)
    if standalone and nnodes not in (None, 1):
        raise usage_error(
            f"--standalone with --nnodes {nnodes}: standalone is one node; drop one of them"
        )
    # A host list makes this process the launcher of every node, not one node of a job.
    on_hosts = hostfile is not None or host_list is not None
    given_node_rank = node_rank
    nnodes, node_rank, master_addr, master_port = _node_flags(
        nnodes, node_rank, master_addr, master_port, detect=not standalone and not on_hosts
    )
    opts = RunOptions(
        script=script,
        script_args=tuple(script_args or ()),
        nproc_per_node=nproc_per_node,
        min_nproc_per_node=workers.least if workers.elastic else None,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        log_dir=log_dir,
        rdzv_timeout_s=rdzv_timeout,
        rdzv_id=rdzv_id,
        grace_period_s=grace_period,
        local_ranks_filter=_ranks(local_ranks_filter, nproc_per_node),
        rank_prefix=rank_prefix,
        stop_on_stdin_eof=stop_on_eof,
    )
    on = hostopts.hosts_and_shell(
        hostfile, host_list, include, exclude, remote_shell, ssh_port, ssh_option
    )
    if on is not None and workers.elastic:
        raise usage_error(
            f"-n {nproc} with --hostfile/-H: the host list gives each host's workers (its "
            "slots), and an elastic host list is not supported yet; drop -n, or run one node "
            "with -n MIN:MAX"
        )
    if on is not None and no_ssh:
        _run_this_host(opts, on[0], given_node_rank)
    if on is not None:
        _run_on_hosts(opts, *on)
    if no_ssh:
        raise usage_error("--no-ssh goes with --hostfile or -H (the job's hosts); give one")
    try:
        if doctor:
            validate(opts)  # usage errors first, before any check runs
            _preflight(opts)
        code = launch(opts)
    except LaunchUsageError as e:
        raise usage_error(str(e)) from None
    raise typer.Exit(code)


def _run_on_hosts(opts: RunOptions, hosts: list[Host], shell: RemoteShell) -> None:
    """``--hostfile``/``-H``: one node per host (see :mod:`longboat.launch.multihost`)."""
    from longboat.launch.multihost import DEFAULT_PORT, HostsRun, launch_hosts
    from longboat.launch.run import LaunchUsageError, validate

    if opts.nnodes != 1 or opts.node_rank != 0:
        raise usage_error(
            "--nnodes/--node-rank with --hostfile/-H: the host list sets both; drop them"
        )
    run = HostsRun(
        hosts=tuple(hosts),
        shell=shell,
        # one fresh id for the whole job: every node's launcher must name the same
        node=replace(opts, rdzv_id=opts.rdzv_id or uuid.uuid4().hex),
        master_port=opts.master_port or DEFAULT_PORT,
        master_addr=None if opts.master_addr == "127.0.0.1" else opts.master_addr,
    )
    try:
        validate(replace(opts, nnodes=len(hosts), master_port=run.master_port))
    except LaunchUsageError as e:
        raise usage_error(str(e)) from None
    raise typer.Exit(launch_hosts(run))


def _run_this_host(opts: RunOptions, hosts: list[Host], node_rank: int | None) -> None:
    """``--hostfile ... --no-ssh`` (DeepSpeed's ``--no_ssh``): the host list gives the job's
    shape, this process starts this host's node only."""
    import os
    import socket

    from longboat.launch.multihost import DEFAULT_PORT
    from longboat.launch.run import LaunchUsageError, launch, validate

    names = [h.name for h in hosts]
    if node_rank is None:
        me = socket.gethostname()
        mine = [i for i, n in enumerate(names) if n in (me, me.split(".")[0])]
        if len(mine) != 1:
            raise usage_error(
                f"--no-ssh: this host ({me}) is not once in the host list ({', '.join(names)}); "
                "give its place with --node-rank"
            )
        node_rank = mine[0]
    if not 0 <= node_rank < len(hosts):
        raise usage_error(
            f"--node-rank {node_rank} with --no-ssh: the host list has nodes 0 to "
            f"{len(hosts) - 1} ({', '.join(names)})"
        )
    if opts.master_port is None and len(hosts) > 1:
        # Each host runs this command on its own, so no host can pick a free port for the
        # others; a fixed default would make two such jobs on one host meet on it, the second
        # one's nodes joining the first one's rendezvous.
        raise usage_error(
            f"--no-ssh with {len(hosts)} hosts needs --master-port: node 0 ({names[0]}) "
            "listens on it and every host dials it, so give each host the same free port, "
            f"e.g. --master-port {DEFAULT_PORT}"
        )
    host = hosts[node_rank]
    if not host.all_slots:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.slots))
    node = replace(
        opts,
        nnodes=len(hosts),
        node_rank=node_rank,
        nproc_per_node=host.nproc,
        master_addr=names[0] if opts.master_addr == "127.0.0.1" else opts.master_addr,
        master_port=opts.master_port,  # None (one host only): a free port
    )
    try:
        validate(node)
        code = launch(node)
    except LaunchUsageError as e:
        raise usage_error(str(e)) from None
    raise typer.Exit(code)


def _node_flags(
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    detect: bool = True,
) -> tuple[int, int, str, int | None]:
    """The node flags, those left out (None) read from Slurm or a PyTorchJob if one started us
    (:mod:`longboat.launch.node_env`), else one node on 127.0.0.1; given ones always win."""
    from longboat.launch import node_env

    given = {"--nnodes": nnodes, "--node-rank": node_rank, "--master-addr": master_addr}
    detected = None
    if detect and None in (*given.values(), master_port):
        try:
            detected = node_env.detect(os.environ)
        except node_env.NodeEnvError as e:
            raise usage_error(str(e)) from None
    found = detected or node_env.NodeDefaults(1, 0, "127.0.0.1", None, source="one local node")
    filled = (
        found.nnodes if nnodes is None else nnodes,
        found.node_rank if node_rank is None else node_rank,
        found.master_addr if master_addr is None else master_addr,
        found.master_port if master_port is None else master_port,
    )
    if detected is not None:
        given["--master-port"] = master_port
        kept = [flag for flag, value in given.items() if value is not None]
        nodes, rank, addr, port = filled
        print(
            f"longboat: node {rank} of {nodes} from {found.source}; master {addr}"
            + (" (a free port)" if port is None else f":{port}")
            + (f"; {', '.join(kept)} as given" if kept else ""),
            file=sys.stderr,
            flush=True,
        )
    return filled


def _nnodes(text: str | None) -> int | None:
    """``--nnodes N``; torchrun's elastic ``MIN:MAX`` is refused with what works instead."""
    if text is None:
        return None
    if ":" in text:
        low, _, high = text.partition(":")
        if low.strip() == high.strip() and low.strip().isdigit():
            return int(low)  # torchrun writes a fixed count as N:N too
        raise usage_error(
            f"--nnodes {text}: a range of nodes (torchrun's elastic rendezvous) is not "
            "supported; give a fixed --nnodes, and -n MIN:MAX to let each node restart with "
            "fewer workers"
        )
    try:
        return int(text)
    except ValueError:
        raise usage_error(f"--nnodes {text!r} is not a number of nodes: e.g. --nnodes 2") from None


def _ranks(text: str | None, nproc_per_node: int) -> frozenset[int] | None:
    """``--local-ranks-filter``'s comma-separated local ranks."""
    if text is None:
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise usage_error(
            f"--local-ranks-filter {text!r} is invalid: give local ranks separated by commas, "
            "e.g. 0 or 0,1"
        ) from None
    bad = sorted(r for r in ranks if not 0 <= r < nproc_per_node)
    if bad or not ranks:
        raise usage_error(
            f"--local-ranks-filter {text!r}: local rank(s) {bad or 'none'} not in 0.."
            f"{nproc_per_node - 1} (-n {nproc_per_node})"
        )
    return ranks


def _preflight(opts: RunOptions) -> None:
    """``run --doctor``: the doctor's checks for this run; exit 1 without starting on failure."""
    from longboat.launch.doctor import DoctorOptions, doctor

    code = doctor(
        DoctorOptions(
            nproc_per_node=opts.nproc_per_node,
            nnodes=opts.nnodes,
            node_rank=opts.node_rank,
            master_addr=opts.master_addr,
            master_port=opts.master_port,
            timeout_s=min(opts.rdzv_timeout_s, 60),
        )
    )
    if code != 0:
        print(
            f"longboat: not starting {opts.script}: fix the problems above (or drop --doctor)",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(code)
