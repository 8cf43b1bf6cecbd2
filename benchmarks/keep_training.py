"""Keep training through SIGKILLs: in-job recovery with replacements against the same run
undisturbed (docs/recovery.md).

Two runs of ``longboat run -n 4 --max-restarts K`` on this file's worker (strategy
``replicate``, ``recovery.in_job``, a small MLP with AdamW over a synthetic data set, micro-batch
16 per rank, each step padded to ``--step-s`` seconds of wall time so that the run's length
does not depend on how busy the machine is and stands for a larger model's compute):

1. undisturbed, ``--steps`` steps;
2. the same, while this process SIGKILLs one worker every 15-20 s (uniform, seeded by
   ``--seed``; the rank drawn at random among the four, waiting first until the world is whole
   again so that every kill hits a member), until ``--kills`` kills; the launcher starts a
   replacement each time, which joins from a live peer's state.

Every worker appends one JSON line per completed step (step, world size, wall time, loss) and
the times of the recovery's log lines. Recorded in the results file:

- ``kills``; ``checkpoint_reads``: lines in the launcher's output that say a checkpoint was loaded
  (none is configured: this counts, it does not assume) plus restarts of the whole job;
- ``seconds_per_failure``: (disturbed wall time - steps / undisturbed step rate) / kills, and per
  phase (medians over the kills): ``detect`` (kill to the survivors' agreement starting),
  ``agree`` and ``regroup`` (from the survivors' log lines), ``replacement_start`` (kill to the
  replacement asking to join: process start, imports, building its engine alone; the others
  train meanwhile), ``join_agree``/``join_regroup``/``transfer`` (the members' pause to take it
  in);
- ``steps_lost``: steps trained and thrown away (each failed step is redone once);
- both loss curves (mean loss over the ranks, per step). They are bit-equal up to the step
  before the first kill, where the data order is the same; after it the global batch shrinks
  with the world and grows back, so the disturbed run sees other batches.

With ``--hybrid``: strategy ``zero`` (stage 2) over hybrid sharding, 2 replicas x 2 shards
(``mesh.dp_replicate = 2``). A kill takes its replica with it: the dead rank's partner leaves
that replica and is replaced too, and the two replacements are taken in together, one whole
replica again (``--max-restarts`` is twice the kills, plus 2).

Measure it alone on the machine: each run records the load averages before and after it.

Usage::

    python benchmarks/keep_training.py --steps 1800 --step-s 0.1 --kills 10
    python benchmarks/keep_training.py --steps 1800 --step-s 0.1 --kills 10 --hybrid

Writes ``benchmarks/results/keep_training.json`` (``keep_training_hybrid.json`` with
``--hybrid``; ``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORLD = 4
MICRO = 16
SAMPLES = 4096
CONFIG: dict[str, Any] = {
    "strategy": "replicate",
    "seed": 0,
    "batch": {"micro_batch_size": MICRO, "gradient_accumulation_steps": 1},
    "log": {"progress": False},
    # comm.timeout_s at its default: a survivor that is not the lost rank's neighbour in
    # gloo's ring all-reduce learns of the loss through the store ([Note: watched waits]).
    "recovery": {"in_job": True, "wait_s": 15},
}
HYBRID: dict[str, Any] = {"strategy": "zero", "zero": {"stage": 2}, "mesh": {"dp_replicate": 2}}


def config_of(hybrid: bool) -> dict[str, Any]:
    return {**CONFIG, **HYBRID} if hybrid else dict(CONFIG)


def worker(out: Path, steps: int, step_s: float, hybrid: bool) -> None:
    """One rank: train ``steps`` steps, one JSON line per step and per recovery log line."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import longboat

    torch.set_num_threads(1)
    me = int(os.environ["RANK"])
    ident = os.environ.get("LONGBOAT_REPLACEMENT_ID", str(me))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid.{me}").write_text(str(os.getpid()))
    events = open(out / f"events.{ident}.jsonl", "a", buffering=1)  # noqa: SIM115

    class Times(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "in-job recovery" in text:
                events.write(json.dumps({"t": time.time(), "msg": text}) + "\n")

    logging.getLogger("longboat").addHandler(Times())
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 64, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)
    )
    engine = longboat.initialize(model, optimizer, config_of(hybrid))
    loader = engine.loader(data)
    lines = open(out / f"steps.{ident}.jsonl", "a", buffering=1)  # noqa: SIM115
    loss_fn = nn.CrossEntropyLoss()
    began = time.monotonic()
    while engine.global_step < steps:
        for x, y in loader:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            rank, world = engine.world.rank, engine.world.world_size
            rest = step_s - (time.monotonic() - began)
            if rest > 0:
                time.sleep(rest)
            if not engine.step():
                continue
            began = time.monotonic()
            rec = {"step": engine.global_step, "rank": rank, "world": world, "loss": float(loss)}
            lines.write(json.dumps({**rec, "t": time.time()}) + "\n")
            if engine.global_step >= steps:
                break
    engine.close()


def _run(
    out: Path, steps: int, step_s: float, kills: int, seed: int, hybrid: bool
) -> dict[str, Any]:
    """One ``longboat run``; with ``kills``, SIGKILL a worker every 15-20 s until that many."""
    cmd = [
        sys.executable, "-m", "longboat.cli", "run", "-n", str(WORLD),
        "--max-restarts", str(_restarts(kills, hybrid)), __file__, "--worker", str(out),
        "--steps", str(steps), "--step-s", str(step_s), *(["--hybrid"] if hybrid else []),
    ]  # fmt: skip
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115
    load_before = os.getloadavg()  # recorded: other work on the machine skews every timing
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    next_at = t0 + rng.uniform(15, 20)
    while proc.poll() is None:
        time.sleep(0.1)
        if len(done) >= kills or time.time() < next_at:
            continue
        if _latest_world(out) < WORLD:  # every kill hits a member of a whole world
            continue
        rank = rng.randrange(WORLD)
        pid = int((out / f"pid.{rank}").read_text())
        at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        done.append({"rank": rank, "pid": pid, "t": at})
        next_at = at + rng.uniform(15, 20)
    log.close()
    wall = time.time() - t0
    load = {"before": load_before, "after": os.getloadavg()}
    return {"code": proc.returncode, "wall_s": wall, "kills": done, "load_avg_1_5_15": load}


def _restarts(kills: int, hybrid: bool) -> int:
    """Enough for every kill: under hybrid sharding the dead rank's partner is replaced too."""
    return (2 * kills if hybrid else kills) + 2


def _latest_world(out: Path) -> int:
    latest = (0, 0)
    for f in out.glob("steps.*.jsonl"):
        lines = f.read_text().splitlines()
        try:
            rec = json.loads(lines[-1])
        except (IndexError, ValueError):  # empty, or a line still being written
            continue
        latest = max(latest, (rec["step"], rec["world"]))
    return latest[1]


def _curve(out: Path) -> tuple[list[float], list[int], dict[tuple[int, int], float]]:
    """Mean loss over the ranks that recorded it (summed in rank order) and world size, per
    step; and every (step, rank)'s loss. A rank killed between a step and its record leaves
    that step's mean to the others."""
    per: dict[int, dict[int, float]] = {}
    world: dict[int, int] = {}
    for f in out.glob("steps.*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by the kill
                continue
            per.setdefault(rec["step"], {})[rec["rank"]] = rec["loss"]
            world[rec["step"]] = rec["world"]
    steps = sorted(per)
    mean = [sum(v for _, v in sorted(per[s].items())) / len(per[s]) for s in steps]
    each = {(s, r): v for s in steps for r, v in per[s].items()}
    return mean, [world[s] for s in steps], each


_AGREE = re.compile(r"\(agree ([\d.]+) s, regroup ([\d.]+) s\)")
_SENT = re.compile(r"state sent to the replacement \(([\d.]+) s\)")


def _phases(out: Path, kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kill: the phases, from the workers' timed log lines (medians over the kills)."""
    events = []
    for f in out.glob("events.*.jsonl"):
        events += [json.loads(line) for line in f.read_text().splitlines()]
    events.sort(key=lambda e: e["t"])
    rows = []
    for i, k in enumerate(kills):
        until = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        mine = [e for e in events if k["t"] <= e["t"] < until]
        lost = [e for e in mine if "lost rank(s)" in e["msg"]]
        taken = [e for e in mine if "taken in after step" in e["msg"]]
        asked = [e for e in mine if "taken in as rank" in e["msg"]]
        sent = [e for e in mine if "state sent" in e["msg"]]
        row: dict[str, float] = {}
        if lost:
            a, r = map(float, _AGREE.search(lost[0]["msg"]).groups())  # type: ignore[union-attr]
            row |= {"detect": lost[0]["t"] - a - r - k["t"], "agree": a, "regroup": r}
        if taken:
            a, r = map(float, _AGREE.search(taken[0]["msg"]).groups())  # type: ignore[union-attr]
            row |= {
                "join_agree": a,
                "join_regroup": r,
                "replacement_start": taken[0]["t"] - a - r - k["t"],
            }
        if sent:
            said = _SENT.search(sent[0]["msg"])
            if said is not None:
                row["transfer"] = float(said.group(1))
        row["taken_in"] = bool(taken or asked)
        rows.append(row)
    keys = [
        "detect",
        "agree",
        "regroup",
        "replacement_start",
        "join_agree",
        "join_regroup",
        "transfer",
    ]
    medians = {
        key: statistics.median(v) for key in keys if (v := [r[key] for r in rows if key in r])
    }
    return {"per_kill": rows, "median_s": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hybrid", action="store_true", help="ZeRO-2 over 2 replicas x 2 shards")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the runs' logs and records here")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.step_s, args.hybrid)
        return
    name = "keep_training_hybrid.json" if args.hybrid else "keep_training.json"
    out_file = args.out or RESULTS / name
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import machine, versions

    with tempfile.TemporaryDirectory(prefix="keep-training-") as tmp:
        base = args.keep or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        calm = _run(base / "undisturbed", args.steps, args.step_s, 0, args.seed, args.hybrid)
        hit = _run(base / "disturbed", args.steps, args.step_s, args.kills, args.seed, args.hybrid)
        calm_loss, _, calm_each = _curve(base / "undisturbed")
        hit_loss, hit_world, hit_each = _curve(base / "disturbed")
        log = (base / "disturbed.log").read_text()
        phases = _phases(base / "disturbed", hit["kills"])
    first = min((s for s, w in enumerate(hit_world) if w < WORLD), default=len(hit_world))
    rate = args.steps / calm["wall_s"]
    kills = len(hit["kills"])
    reads = len(re.findall(r"loaded checkpoint|checkpoint .* loaded", log))
    restarts = len(re.findall(r"restarting all workers|Restarting worker group", log))
    # One regroup after a loss per generation, and each redoes the one step that failed.
    redone = len(set(re.findall(r"lost rank\(s\) .*? generation (\d+):", log)))
    result = {
        "benchmark": "keep_training",
        "command": (
            f"python benchmarks/keep_training.py --steps {args.steps} --step-s {args.step_s} "
            f"--kills {args.kills} --seed {args.seed}" + (" --hybrid" if args.hybrid else "")
        ),
        "config": {
            **config_of(args.hybrid),
            "ranks": WORLD,
            "model": "MLP 64-256-256-10",
            "optimizer": "AdamW lr 1e-3",
            "samples": SAMPLES,
            "steps": args.steps,
            "step_padded_to_s": args.step_s,
            "kill_every_s": [15, 20],
            "max_restarts": _restarts(args.kills, args.hybrid),
        },
        "versions": versions(),
        "machine": machine(),
        "undisturbed": {
            "exit": calm["code"],
            "wall_s": calm["wall_s"],
            "steps_per_s": rate,
            "load_avg_1_5_15": calm["load_avg_1_5_15"],
        },
        "disturbed": {
            "exit": hit["code"],
            "wall_s": hit["wall_s"],
            "kill_log": hit["kills"],
            "load_avg_1_5_15": hit["load_avg_1_5_15"],
        },
        "kills": kills,
        "checkpoint_reads": reads + restarts,
        "seconds_per_failure": (hit["wall_s"] - args.steps / rate) / kills if kills else None,
        "phases": phases,
        "steps_lost": redone,
        "loss_curves": {
            "undisturbed": calm_loss,
            "disturbed": hit_loss,
            "disturbed_world": hit_world,
        },
        "curves_equal_until_step": first,
        # rank by rank: a rank killed between a step and its record leaves a mean of fewer
        "curves_bit_equal_there": all(
            calm_each[k] == v for k, v in hit_each.items() if k[0] <= first
        ),
        "notes": [
            "load_avg_1_5_15: the machine's load averages before and after each run, since "
            "other work on the machine skews every timing here.",
            "Under --hybrid a kill takes its replica (its shard group) with it: the dead "
            "rank's partner leaves and is replaced too (--max-restarts counts both), the "
            "survivors train on as one replica of 2 ranks, and the two replacements are taken "
            "in together; replacement_start is the kill to that moment.",
            "Each step is padded to step_padded_to_s of wall time, so steps per second do not "
            "depend on the world size: lost time is time in which no step completed.",
            "comm.timeout_s at its default (600 s), recovery.wait_s = 15: a survivor that is "
            "not the lost rank's neighbour in gloo's ring all-reduce (buffers this large) gets "
            "no connection error and learns of the loss through the store (its wait asks every "
            "0.15 s while a collective is pending).",
            "steps_lost counts failed steps redone (each once); the samples of a step trained "
            "at a smaller world are not lost, the global batch is smaller there.",
        ],
    }
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "kills",
                    "checkpoint_reads",
                    "seconds_per_failure",
                    "steps_lost",
                    "curves_equal_until_step",
                    "curves_bit_equal_there",
                )
            }
        )
    )
    print(json.dumps(phases["median_s"]))


if __name__ == "__main__":
    main()
