"""Hang and lost-peer reports: when a collective times out or a peer dies, every surviving rank
says which ranks did not arrive at which collective and where each rank was last.

Liveness goes through the rendezvous store (the one every rank already talks to): each surviving
rank writes its state under a key, waits briefly for the others, and names those that did not
answer. The report is printed to stderr as one block, written as JSON into
``$LONGBOAT_REPORT_DIR`` when set (``longboat run`` merges those), and raised as
:class:`CollectiveTimeout` or :class:`PeerLost` so the process exits non-zero.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from longboat.comm.errors import CollectiveTimeout, PeerLost
from longboat.comm.trace import CallRecord, python_stack
from longboat.network import node_label

REPORT_DIR_VAR = "LONGBOAT_REPORT_DIR"
# How long a rank waits for its peers' states; the whole report stays within 1 s of the timeout.
_ANSWER_WAIT_S = 0.5


def _store() -> Any:
    """The default group's store, or None (a private torch API, so guarded)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


# Words the backends and the store use when a peer went away (as launch/failures.py reads them).
_PEER_LOSS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
    "distnetworkerror",
    "peer",
    "socket closed",
)


def is_hang_or_loss(err: BaseException) -> bool:
    """True for a timeout or a lost peer; other errors (a bad argument) pass through unchanged."""
    text = f"{type(err).__name__} {err}".lower()
    return is_timeout(err) or any(m in text for m in _PEER_LOSS)


def namespace(group: str) -> str:
    """Store keys for this group's reports; the restart count keeps attempts apart when a
    launcher (torchrun) reuses one store for every attempt."""
    return f"longboat/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{group}"


def is_timeout(err: BaseException) -> bool:
    """True when ``err`` says an operation timed out (not that a peer went away)."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def build_report(
    *,
    rank: int,
    world_size: int,
    namespace: str,
    current: CallRecord | None,
    last_done: CallRecord | None,
    peer_last: CallRecord | None,
    error: BaseException,
    timeout_s: float,
) -> dict[str, Any]:
    """Share this rank's state through the store, collect the peers' and return the report."""
    timed_out = is_timeout(error)
    mine = {
        "rank": rank,
        "node": _node_rank(),
        "pid": os.getpid(),
        "current": current.as_json() if current else None,
        "last_completed": last_done.as_json() if last_done else None,
        "stack": python_stack(),
    }
    peers = _exchange(_store(), namespace, rank, world_size, mine)
    cur_seq = current.seq if current else None
    missing = [
        r
        for r in range(world_size)
        if r != rank
        and (
            r not in peers
            or (peers[r] or {}).get("current", {}) is None
            or (peers[r] or {}).get("current", {}).get("seq") != cur_seq
        )
    ]
    return {
        "kind": "timeout" if timed_out else "peer_lost",
        "lost_nodes": _lost_nodes(mine, peers),
        "rank": rank,
        "world_size": world_size,
        "timeout_s": timeout_s,
        "error": f"{type(error).__name__}: {error}".strip()[:2000],
        "collective": mine["current"],
        "not_arrived": missing,
        "peer_last_known": peer_last.as_json() if peer_last else None,
        "ranks": {str(rank): mine, **{str(r): s for r, s in peers.items()}},
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _exchange(
    store: Any, namespace: str, rank: int, world_size: int, mine: dict[str, Any]
) -> dict[int, dict[str, Any] | None]:
    """Write this rank's state, read the peers' that come within the answer wait.

    On a thread, abandoned after the wait: when the store's host is the one cut off, a store
    call blocks in the socket well past the store's own timeout (measured with a link cut in
    tests/test_multihost.py), and the report must not wait on it.
    """
    peers: dict[int, dict[str, Any] | None] = {}
    if store is None:
        return peers

    def run() -> None:
        try:
            store.set(f"{namespace}/{rank}", json.dumps(mine))
            deadline = time.monotonic() + _ANSWER_WAIT_S
            pending = [r for r in range(world_size) if r != rank]
            while pending and time.monotonic() < deadline:
                for r in list(pending):
                    if store.check([f"{namespace}/{r}"]):
                        peers[r] = json.loads(store.get(f"{namespace}/{r}"))
                        pending.remove(r)
                if pending:
                    time.sleep(0.02)
        except Exception:  # the store's host may be the dead peer: report what we know
            pass

    worker = threading.Thread(target=run, name="longboat-hang-report", daemon=True)
    worker.start()
    worker.join(_ANSWER_WAIT_S + 0.2)
    return dict(peers)


def _node_rank() -> int | None:
    """This rank's node (torch elastic's GROUP_RANK), None when not started by an agent."""
    value = os.environ.get("GROUP_RANK")
    return int(value) if value is not None and value.isdigit() else None


def _lost_nodes(mine: dict[str, Any], peers: dict[int, dict[str, Any] | None]) -> list[int]:
    """Nodes none of whose ranks answered: from this rank's view, the hosts it lost.

    Every rank of a node that is alive answers (it is in the same collective, or stuck beside
    it); a node cut off from this one answers with none. Known only under an agent, which sets
    GROUP_RANK and GROUP_WORLD_SIZE (the node count).
    """
    nnodes = os.environ.get("GROUP_WORLD_SIZE", "")
    if mine.get("node") is None or not nnodes.isdigit():
        return []
    answered = {mine["node"]} | {(p or {}).get("node") for p in peers.values()}
    return [n for n in range(int(nnodes)) if n not in answered]


def _describe(rec: dict[str, Any] | None) -> str:
    if not rec:
        return "nothing"
    return CallRecord(
        **{
            **rec,
            "shape": tuple(rec["shape"]),
            "out_shape": (tuple(rec["out_shape"]) if rec["out_shape"] is not None else None),
        }
    ).describe()


def format_report(rep: dict[str, Any]) -> str:
    """The block printed to stderr (and by the launcher)."""
    what = (
        f"collective timed out after {rep['timeout_s']:g} s"
        if rep["kind"] == "timeout"
        else "a peer was lost during a collective"
    )
    lines = [
        f"longboat: {what} on rank {rep['rank']} of {rep['world_size']}",
        f"  waiting in: {_describe(rep['collective'])}",
    ]
    lost = rep.get("lost_nodes") or []
    if lost:
        lines.append(
            f"  lost: {', '.join(node_label(n) for n in lost)}: none of its ranks answered "
            f"(unreachable from {node_label(rep['ranks'][str(rep['rank'])]['node'])}, or down)"
        )
    if rep["not_arrived"]:
        known = _describe(rep["peer_last_known"]) if rep["peer_last_known"] else "unknown"
        lines.append(
            f"  did not arrive: rank(s) {', '.join(map(str, rep['not_arrived']))}"
            f" (last collective all ranks agreed on: {known}; the line is this rank's, theirs"
            " is not known)"
        )
    for r in range(rep["world_size"]):
        state = rep["ranks"].get(str(r))
        if state is None:
            lines.append(
                f"  rank {r}: no answer within {_ANSWER_WAIT_S:g} s (stopped, dead, exited, or"
                " busy outside a collective: where it is is not known)"
            )
            continue
        lines.append(
            f"  rank {r} (pid {state['pid']}): in {_describe(state['current'])}; last "
            f"completed {_describe(state['last_completed'])}"
        )
        lines.extend("    " + s for s in state["stack"].rstrip().splitlines()[-8:])
    lines.append(f"  error: {rep['error'].splitlines()[0] if rep['error'] else ''}")
    return "\n".join(lines)


def publish(rep: dict[str, Any]) -> str:
    """Print the report to stderr, write it into ``$LONGBOAT_REPORT_DIR``; return its text."""
    text = format_report(rep)
    print(text, file=sys.stderr, flush=True)
    directory = os.environ.get(REPORT_DIR_VAR)
    if directory:
        try:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".rank{rep['rank']}.json.tmp"
            tmp.write_text(json.dumps(rep, indent=1))
            tmp.replace(path / f"rank{rep['rank']}.json")
        except OSError as e:  # the report on stderr still stands
            print(
                f"longboat: could not write the hang report into {directory}: {e}", file=sys.stderr
            )
    return text


def raise_report(rep: dict[str, Any], error: BaseException) -> None:
    """Publish the report, then raise a one-line summary of it: the report itself (with the
    backend's error) is already on stderr, and repeating it in the traceback buries it."""
    text = publish(rep)
    cls = CollectiveTimeout if rep["kind"] == "timeout" else PeerLost
    summary = text.splitlines()[0].removeprefix("longboat: ")
    if rep["not_arrived"]:
        summary += (
            f": rank(s) {', '.join(map(str, rep['not_arrived']))} did not arrive at "
            f"{_describe(rep['collective'])}"
        )
    raise cls(f"{summary} (report above)") from None
