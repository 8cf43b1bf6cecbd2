"""Worlds of rank processes that run a list of tasks, each under a hard time limit.

A world (:class:`WorldSpec`) is ``size`` processes, started once and reused for task after task,
because starting a process that imports torch and longboat and initialises CUDA costs seconds
while most tasks take less. Each rank runs every task in order (:mod:`gpucheck.rank`); rank 0
then runs the task's ``finish`` on what every rank returned (the comparison with the plain loop)
and writes the task's outcome, which is all this side reads.

[Note: one failure, one restart] A task whose rank raises, dies or does not answer in time may
leave the others inside a collective that will never complete, and a process group after a
failed collective cannot be trusted. So any failure ends the world: its processes (and their
process groups: inductor's compile workers too) are killed with SIGKILL, which a process stuck
in a collective cannot ignore, the failure is recorded with each rank's error and the end of its
log, and a fresh world starts at the next task. Nothing a task does can stop the tasks after it,
and nothing can outlive its time limit or the caller's deadline.

This module runs in the parent and imports neither torch nor longboat.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
POLL_S = 0.05


@dataclass(frozen=True)
class Task:
    """One piece of work for every rank of a world.

    ``run`` and ``finish`` name functions as ``"module:function"``: ``run(args, ctx)`` runs on
    every rank and returns a picklable value (CPU tensors, numbers, lists, dicts);
    ``finish(args, ctx, results)`` runs on rank 0 with every rank's value, in rank order, and
    returns the JSON-able outcome. Without ``finish`` the outcome is rank 0's value, which must
    then be JSON-able itself."""

    name: str
    run: str
    args: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    finish: str | None = None
    #: when this task fails, the world's later tasks are skipped (a probe whose failure means
    #: that the rest cannot work either)
    gate: bool = False


@dataclass(frozen=True)
class WorldSpec:
    """``size`` ranks joined by ``backend`` ("nccl", "gloo", or "none": one process and no
    process group, as ``python train.py``), computing on ``device`` ("cuda" or "cpu")."""

    name: str
    size: int
    backend: str
    device: str
    threads: int = 1
    #: one GPU for every rank (``cuda:0``) instead of ``cuda:rank % device_count``
    share_gpu: bool = False


@dataclass(frozen=True)
class RankContext:
    """What a task function is told about the rank it runs on."""

    rank: int
    world_size: int
    device: str  # "cuda:N" or "cpu"
    backend: str
    dry: bool


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` so that a reader never sees half of it (a rename is atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def child_env(dry: bool) -> dict[str, str]:
    """The ranks' environment: this one, with the benchmarks and longboat's sources first on
    the path (so the ranks run the code of this work tree), and no GPU in a dry run."""
    env = dict(os.environ)
    path = [str(BENCHMARKS), str(REPO / "src")]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    if dry:  # a dry run checks the code paths on the CPU, even on a machine with a GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"  # a rank killed for a hang has its last words in its log
    return env


class _World:
    """The processes of one world, started at task ``start`` ([Note: one failure, one
    restart])."""

    def __init__(
        self,
        spec: WorldSpec,
        tasks: list[Task],
        start: int,
        workdir: Path,
        env: dict[str, str],
        dry: bool,
    ) -> None:
        self.spec = spec
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{spec.name}.from{start}.", dir=workdir))
        write_json(
            self.dir / "spec.json",
            {
                "world": asdict(spec),
                "tasks": [asdict(t) for t in tasks],
                "start": start,
                "port": free_port(),
                "parent_pid": os.getpid(),
                "dry": dry,
            },
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(spec.size):
            with open(self.dir / f"rank{r}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "gpucheck.rank", str(self.dir), str(r)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=REPO,
                        # its own process group, so that killing it reaches its children
                        start_new_session=True,
                    )
                )

    def log_tail(self, rank: int, chars: int = 3000) -> str:
        return _tail(self.dir / f"rank{rank}.log", chars)

    def exited(self) -> dict[int, int]:
        """Ranks whose process has ended, with their exit codes."""
        return {r: code for r, p in enumerate(self.procs) if (code := p.poll()) is not None}

    def ready(self) -> bool:
        return all((self.dir / f"ready.{r}").exists() for r in range(self.spec.size))

    def rank_status(self, k: int) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.spec.size):
            s = _read_json(self.dir / f"{k}.rank{r}.json")
            if s is not None:
                out[r] = s
        return out

    def done(self, k: int) -> dict[str, Any] | None:
        return _read_json(self.dir / f"{k}.done.json")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            # Children a rank left behind (inductor's compile workers) share its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def close(self, wait_s: float = 5.0) -> None:
        """After the last task: let the ranks exit by themselves, then make sure."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end and len(self.exited()) < len(self.procs):
            time.sleep(POLL_S)
        self.kill()

    def problem(self, k: int) -> str | None:
        """Why task ``k`` cannot finish, if some rank already says so: its error, or its exit
        without an answer."""
        statuses = self.rank_status(k)
        errors = [f"rank {r}: {s['error']}" for r, s in statuses.items() if s["status"] != "ok"]
        for r, code in self.exited().items():
            answered = r in statuses and (r != 0 or self.done(k) is not None)
            if not answered and not any(e.startswith(f"rank {r}:") for e in errors):
                errors.append(f"rank {r}: exited with code {code} without an answer")
        return "\n".join(errors) or None

    def dump_stacks(self, wait_s: float = 1.5) -> None:
        """Ask the ranks still running to write every thread's stack to their logs (they
        register faulthandler on SIGUSR1): where a stuck rank is stuck."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
        if alive:
            time.sleep(wait_s)

    def logs(self) -> dict[str, str]:
        """The end of every rank's log (NCCL's and CUDA's own messages land there)."""
        return {f"rank{r}": self.log_tail(r) for r in range(self.spec.size)}


def _record(task: Task, status: str, seconds: float | None, **extra: Any) -> dict[str, Any]:
    return {"task": task.name, "status": status, "seconds": seconds, **extra}


def run_world(
    spec: WorldSpec,
    tasks: list[Task],
    deadline: float,
    workdir: Path,
    *,
    dry: bool,
    start_timeout_s: float = 120.0,
    grace_s: float = 5.0,
    log: Any = None,
) -> list[dict[str, Any]]:
    """Run ``tasks`` on a world of ``spec``; one record per task, in order:
    ``{"task", "status": "ok" | "error" | "timeout" | "skipped", "seconds", "result" | "error"}``.

    ``deadline`` (``time.monotonic()``) bounds everything: a task still running then is killed
    and recorded as a timeout, later ones as skipped. ``grace_s``: once a rank has failed, how
    long the others get to answer before they are taken to be stuck."""
    env = child_env(dry)
    records: list[dict[str, Any] | None] = [None] * len(tasks)
    say = log or (lambda _msg: None)
    k = 0
    while k < len(tasks):
        if deadline - time.monotonic() < 5.0:
            break
        world = _World(spec, tasks, k, workdir, env, dry)
        t0 = time.monotonic()
        start_by = min(t0 + start_timeout_s, deadline)
        while not world.ready():
            code = world.exited()
            if code or time.monotonic() > start_by:
                why = (
                    f"rank(s) exited while starting: {code}"
                    if code
                    else f"the world did not start within {time.monotonic() - t0:.0f} s"
                )
                world.kill()
                records[k] = _record(tasks[k], "error", None, error=why, logs=world.logs())
                for j in range(k + 1, len(tasks)):
                    records[j] = _record(
                        tasks[j], "skipped", None, error="skipped: the world did not start"
                    )
                say(f"  {spec.name}: did not start ({why})")
                return [r for r in records if r is not None]
            time.sleep(POLL_S)
        say(f"  {spec.name}: {spec.size} rank(s) started in {time.monotonic() - t0:.1f} s")
        failed = False
        while k < len(tasks):
            task = tasks[k]
            rec = _wait_task(world, k, task, deadline, grace_s)
            records[k] = rec
            say(f"  {spec.name} / {task.name}: {rec['status']} ({rec['seconds'] or 0:.1f} s)")
            k += 1
            if rec["status"] != "ok":
                failed = True
                world.kill()
                if task.gate:
                    for j in range(k, len(tasks)):
                        records[j] = _record(
                            tasks[j], "skipped", None, error=f"skipped: {task.name} failed"
                        )
                    k = len(tasks)
                break
        if not failed:
            world.close()
    for j, rec in enumerate(records):
        if rec is None:
            records[j] = _record(tasks[j], "skipped", None, error="skipped: deadline")
    return [r for r in records if r is not None]


def _wait_task(
    world: _World, k: int, task: Task, deadline: float, grace_s: float
) -> dict[str, Any]:
    t0 = time.monotonic()
    limit = min(t0 + task.timeout_s, deadline)
    trouble_since: float | None = None
    while True:
        done = world.done(k)
        if done is not None:
            seconds = time.monotonic() - t0
            if done["status"] == "ok":
                return _record(task, "ok", seconds, result=done["result"])
            return _record(task, "error", seconds, error=done["error"], logs=world.logs())
        now = time.monotonic()
        why = world.problem(k)
        if why is not None:
            trouble_since = trouble_since or now
            if now - trouble_since > grace_s:
                world.dump_stacks()  # the ranks that did not fail: where they wait
                return _record(task, "error", now - t0, error=why, logs=world.logs())
        if now > limit:
            cause = "the deadline" if limit == deadline else f"its {task.timeout_s:.0f} s limit"
            what = f"no answer from every rank by {cause} ({now - t0:.0f} s)"
            if why:
                what += "\n" + why
            world.dump_stacks()
            world.kill()  # before reading the logs: a killed rank has written all it will
            return _record(task, "timeout", now - t0, error=what, logs=world.logs())
        time.sleep(POLL_S)
