"""Pipeline stages on the reference GPT: the bubble per schedule and stage, measured against the
simulator's prediction and the theory, the activations each stage holds, and the step time of 2
stages against ``replicate`` on the same 2 ranks.

Every side trains the reference GPT (:func:`longboat.models.reference_gpt`, 21,064,704
parameters, AdamW, clipping 1.0, sequence 128) on 16 samples per optimizer step, with
``engine.train_step``, the defaults a user gets otherwise:

- ``replicate``: 2 data-parallel ranks, 8 samples each, no accumulation (how one would run it);
- ``<schedule>-m<M>-<partition>``: ``[mesh] pp = 2`` (one stage per rank; ``interleaved``:
  ``--virtual-stages`` per rank), ``M`` micro-batches of ``16 / M`` samples, the layers split by
  ``<partition>``: ``measured`` (the default: each piece, a layer or a block's attention or MLP
  half, timed on one micro-batch, the slowest stage made as fast as it can be, then the split
  the schedule simulator predicts fastest for the side's schedule and ``M``) or ``parameters``
  (DeepSpeed's default: embeddings and 2 blocks, then 2 blocks and the head).

Each side runs alone in a fresh pair of processes (``--warmup`` steps, then ``--steps``
measured), the sides' order reversed every other repeat (ABBA). Per step and rank it records the
step time (the MAX over ranks is the step time) and the seconds that rank spent blocked in the
pipeline's doorways (receiving an activation or a gradient its neighbour has not sent yet): the
*measured idle fraction*, against the theory ``(p - 1) / (m + p - 1)`` (equal stages; ZB-H1's
``(p - 1) / (3 m + p - 1)`` with its backward split half and half, ``--schedules zb-h1``;
interleaved, ``(p - 1) / (v m + p - 1)``; ``idle_theory_one_stage_per_rank`` keeps the first for
every side) and, for
the measured split, the idle the schedule simulator predicts from the stages' measured forward
and backward times (``Pipeline.predicted_idle``; transfers free). Transfers count as measured
idle (they are loopback copies here). Per stage, each micro-batch's forward and backward in
training (``training_action_s``, timed around the engine's calls) beside the start-up
profile's (``measured_action_s``): how well the profile the split was chosen from predicts
training. Activations: during one step, the bytes of tensors autograd
saved for backward that are alive at once (parameters excluded, each storage once), per stage;
divided by GPipe's peak over ``m`` (GPipe holds every micro-batch's), that gives the peak in
micro-batches' worth, which 1F1B bounds by ``p - stage``.

Usage::

    python benchmarks/pipeline.py                          # ~10 minutes, on a quiet machine
    python benchmarks/pipeline.py --partitions measured,parameters   # both splits, ~20 minutes
    python benchmarks/pipeline.py --schedules 1f1b,zb-h1,interleaved --micro-batches 8,16 \
        --out benchmarks/results/pipeline_schedules.json     # every schedule, measured split
    python benchmarks/pipeline.py --repeats 3 --sides zb-h1-m8-measured,zb-h1-m8-0.4.6,\
interleaved-m8-measured,interleaved-m8-0.2.3.5.6 --out benchmarks/results/pipeline_parts.json
                                    # the measured split against the best between whole layers
    python benchmarks/pipeline.py --sides interleaved-m8-measured,interleaved-m16-measured \
        --repeats 1 --out benchmarks/results/pipeline_actions_loss.json
                                    # training's per-stage forward/backward beside the profile's
    python benchmarks/pipeline.py --micro-batches 2 --schedules 1f1b --steps 1 --warmup 0 \
        --repeats 1 --out /tmp/pipeline.json               # a smoke run (numbers meaningless)

Writes ``benchmarks/results/pipeline.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "pipeline.json"
GLOBAL_BATCH = 16


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", default="2,4,8", help="pipeline micro-batch counts")
    ap.add_argument("--schedules", default="gpipe,1f1b", help="gpipe, 1f1b, zb-h1, interleaved")
    ap.add_argument(
        "--virtual-stages", type=int, default=2, help="stages per rank under interleaved"
    )
    ap.add_argument(
        "--partitions", default="measured", help="pipeline.partition: measured, parameters"
    )
    ap.add_argument(
        "--sides",
        help="instead of schedules x micro-batches x partitions: SCHEDULE-mM-PARTITION,... "
        "(a partition of dotted boundaries, 0.4.6, cuts between whole layers)",
    )
    ap.add_argument("--steps", type=int, default=6, help="measured steps per side and repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side, write --out
    return ap.parse_args(argv)


class SavedBytes:
    """Bytes of the tensors autograd saved for backward that are alive now, and their peak;
    parameters are left out, a storage saved twice counts once."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or storage.nbytes() == 0:
            return t
        if self.refs.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        # Held detached: a saved output kept with its grad_fn would hold its own node, a cycle
        # through autograd that no collector sees; a graph kept for a later pass (the split
        # backward's retain_graph) would then never be freed, nor counted as freed.
        return _Held(self, t.detach(), ptr, storage.nbytes())

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held

    def release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes


class _Held:
    __slots__ = ("n", "owner", "ptr", "t")

    def __init__(self, owner: SavedBytes, t: torch.Tensor, ptr: int, n: int) -> None:
        self.owner, self.t, self.ptr, self.n = owner, t, ptr, n

    def __del__(self) -> None:
        self.owner.release(self.ptr, self.n)


class ActionTimes:
    """Per stage, the seconds each forward and each backward of one micro-batch took in
    training: the engine's ``forward`` (called with the stage), and its ``backward`` (the last
    stage's loss) or ``backward_from`` (the output of the stage it was forwarded by), timed
    around the call; waits for a neighbour's tensor fall outside them. Under ``zb-h1`` a
    backward is its input-gradient pass (not timed here) and weight pass (``backward_with``,
    counted as ``W``)."""

    def __init__(self, engine: Any) -> None:
        self.keep = False
        self.times: dict[str, dict[str, list[float]]] = {}
        self.stage_of: dict[int, int] = {}
        self.last = engine.schedule.stages - 1
        forward, backward = engine.forward, engine.backward
        backward_from, backward_with = engine.backward_from, engine.backward_with

        def timed_forward(*a: Any, stage: int, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = forward(*a, stage=stage, **k)
            self._add(stage, "F", t0)
            self.stage_of[id(out)] = stage
            return out

        def timed_backward(loss: torch.Tensor) -> None:
            t0 = time.perf_counter()
            backward(loss)
            self._add(self.last, "B", t0)

        def timed_backward_from(out: torch.Tensor, grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            backward_from(out, grad)
            self._add(self.stage_of.pop(id(out), -1), "B", t0)

        def timed_backward_with(w: Any) -> None:
            t0 = time.perf_counter()
            backward_with(w)
            self._add(-1, "W", t0)

        engine.forward, engine.backward = timed_forward, timed_backward
        engine.backward_from, engine.backward_with = timed_backward_from, timed_backward_with

    def _add(self, stage: int, op: str, t0: float) -> None:
        if self.keep:
            dt = time.perf_counter() - t0
            self.times.setdefault(str(stage), {}).setdefault(op, []).append(dt)

    def medians(self) -> dict[str, dict[str, float]]:
        return _medians(self.times)


def _config(side: str, virtual: int = 2) -> dict[str, Any]:
    base: dict[str, Any] = {
        "log": {"progress": False, "level": "WARNING"},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
    }
    if side == "replicate":
        return {**base, "batch": {"train_batch_size": GLOBAL_BATCH, "micro_batch_size": 8}}
    schedule, m, partition = _side(side)
    pipeline: dict[str, Any] = {"schedule": schedule, "partition": _partition(partition)}
    if schedule == "interleaved":
        pipeline["virtual_stages"] = virtual
    return {
        **base,
        "mesh": {"pp": 2},
        "pipeline": pipeline,
        "batch": {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": int(m)},
    }


def _partition(name: str) -> str | list[int]:
    """A side's ``pipeline.partition``: a method's name, or boundaries between whole layers
    written with dots (``0.4.6``: embeddings and 3 blocks, then a block and the head)."""
    return [int(b) for b in name.split(".")] if re.fullmatch(r"\d+(\.\d+)+", name) else name


def _side(side: str) -> tuple[str, int, str]:
    """``"1f1b-m4-measured"`` -> schedule, micro-batches, partition (``"zb-h1-m4-measured"``:
    the schedule's own name has a dash)."""
    found = re.fullmatch(r"(.+?)-m(\d+)-(.+)", side)
    assert found is not None, side
    return found[1], int(found[2]), found[3]


def _medians(per: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in sorted(per.items())
    }


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    join_loopback(rank, 2, port, args.threads)
    try:
        _run_side(rank, args)
    finally:
        dist.destroy_process_group()


def _run_side(rank: int, args: argparse.Namespace) -> None:
    import longboat
    from longboat.models import gpt_loss, reference_gpt, synthetic_tokens

    torch.manual_seed(0)
    model = reference_gpt()
    cfg = _config(args.side, args.virtual_stages)
    micro = GLOBAL_BATCH // cfg["batch"].get("gradient_accumulation_steps", 2)
    # one micro-batch's tokens, for the measured split to time the layers on
    example = synthetic_tokens(micro, model.seq_len, model.vocab_size, torch.Generator())[0]
    engine = longboat.initialize(model, None, cfg, example_input=example)
    per_rank = engine.batch.micro_batch_size * engine.accumulation_steps
    g = torch.Generator().manual_seed(1000 + engine.topology.coords["dp"])
    pp = [engine.topology.data("pp"), engine.topology.control("pp")]
    saved = SavedBytes(list(engine.model.parameters()))
    actions = ActionTimes(engine) if args.side != "replicate" else None
    steps, idle, peaks, losses = [], [], [], []
    for i in range(args.warmup + args.steps):
        batch = synthetic_tokens(per_rank, model.seq_len, model.vocab_size, g)
        blocked0 = sum(d.blocked_seconds for d in pp)
        saved.peak = saved.live
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = engine.train_step(batch, lambda out, mb: gpt_loss(out, mb[1]))
        dt = time.perf_counter() - t0
        blocked = sum(d.blocked_seconds for d in pp) - blocked0
        t = torch.tensor([dt])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step time a synchronous job sees
        if actions is not None:
            actions.keep = i >= args.warmup
        if i >= args.warmup:
            steps.append(float(t))
            idle.append(blocked / dt)
            peaks.append(saved.peak)
            losses.append(loss)
    stage = engine.topology.coords["pp"]
    mine = {"stage": stage, "idle": idle, "peak_saved_bytes": max(peaks), "losses": losses}
    pipe: Any = engine.schedule  # a Pipeline (pp = 2): its split and prediction
    if args.side != "replicate":
        mine["bounds"] = pipe.bounds
        if pipe.stage_costs is not None:
            m = engine.accumulation_steps
            mine["idle_predicted"] = pipe.predicted_idle(m)[stage]
            fwd, bwd = pipe.stage_costs
            mine["stage_measured_s"] = sum(fwd[s] + bwd[s] for s in pipe.held_stages)
            mine["measured_action_s"] = {
                str(s): {"F": fwd[s], "B": bwd[s]} for s in pipe.held_stages
            }
        assert actions is not None
        mine["training_action_s"] = actions.medians()
    engine.close()
    # Each rank writes its own record; the parent puts them together.
    args.out.with_suffix(f".rank{rank}.json").write_text(json.dumps({"step_s": steps, **mine}))


def _one_side(side: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any] | str:
    import subprocess

    out = tmp / f"{side}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--virtual-stages",
        str(args.virtual_stages),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    files = [out.with_suffix(f".rank{r}.json") for r in range(2)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
    ranks = [json.loads(f.read_text()) for f in files]
    return {"step_s": ranks[0]["step_s"], "ranks": ranks}


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.side:
        mp.spawn(_worker, args=(args, free_port()), nprocs=2, join=True)
        return
    from longboat.pipeline import bubble_theory

    ms = [int(m) for m in args.micro_batches.split(",")]
    sides = ["replicate"] + (
        args.sides.split(",")
        if args.sides
        else [
            f"{s}-m{m}-{p}"
            for p in args.partitions.split(",")
            for s in args.schedules.split(",")
            for m in ms
        ]
    )
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for side in sides if r % 2 == 0 else list(reversed(sides)):
                if side in failed:
                    continue
                res = _one_side(side, args, Path(tmp))
                if isinstance(res, str):
                    failed[side] = res
                    print(f"{side}: FAILED {res}", flush=True)
                    continue
                runs[side].append(res)
                print(f"{side}: median {statistics.median(res['step_s']):.3f} s", flush=True)
    rep = statistics.median(s for run in runs["replicate"] for s in run["step_s"])
    table: dict[str, Any] = {}
    for side in sides[1:]:
        if not runs[side]:
            continue
        schedule, m, partition = _side(side)
        step = statistics.median(s for run in runs[side] for s in run["step_s"])
        stages: dict[int, dict[str, Any]] = {}
        acts: dict[str, dict[str, list[float]]] = {}  # per stage (chunk), per op: seconds
        profiled: dict[str, dict[str, list[float]]] = {}
        for run in runs[side]:
            for rk in run["ranks"]:
                st = stages.setdefault(
                    rk["stage"], {"idle": [], "peak_saved_bytes": 0, "predicted": []}
                )
                st["idle"] += rk["idle"]
                st["peak_saved_bytes"] = max(st["peak_saved_bytes"], rk["peak_saved_bytes"])
                if "idle_predicted" in rk:  # each repeat measures its own split
                    st["predicted"].append(rk["idle_predicted"])
                    st["bounds"], st["measured_s"] = rk["bounds"], rk["stage_measured_s"]
                st.setdefault("bounds", rk["bounds"])
                for chunk, ops in rk.get("training_action_s", {}).items():
                    for op, sec in ops.items():
                        acts.setdefault(chunk, {}).setdefault(op, []).append(sec)
                for chunk, ops in rk.get("measured_action_s", {}).items():
                    for op, sec in ops.items():
                        profiled.setdefault(chunk, {}).setdefault(op, []).append(sec)
        table[side] = {
            "schedule": schedule,
            "micro_batches": m,
            "partition": partition,
            "bounds": stages[0]["bounds"],
            "median_step_s": step,
            "vs_replicate": step / rep,
            "idle_theory": bubble_theory(
                2, m, args.virtual_stages if schedule == "interleaved" else 1, kind=schedule
            ),
            "idle_theory_one_stage_per_rank": bubble_theory(2, m),
            "idle_measured": {s: statistics.median(v["idle"]) for s, v in stages.items()},
            "idle_predicted": {
                s: statistics.median(v["predicted"]) for s, v in stages.items() if v["predicted"]
            },
            "stage_measured_s": {
                s: v["measured_s"] for s, v in stages.items() if "measured_s" in v
            },
            "peak_saved_bytes": {s: v["peak_saved_bytes"] for s, v in stages.items()},
            "training_action_s": _medians(acts),
            "measured_action_s": _medians(profiled),
        }
    for row in table.values():  # peaks in micro-batches' worth, from GPipe at the same m
        g = table.get(f"gpipe-m{row['micro_batches']}-{row['partition']}")
        if g:
            row["peak_micro_batches"] = {
                s: row["peak_saved_bytes"][s] / (g["peak_saved_bytes"][s] / row["micro_batches"])
                for s in row["peak_saved_bytes"]
            }
    result = {
        "benchmark": "pipeline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "replicate_median_step_s": rep,
        "sides": table,
        "failed": failed,
        "raw": runs,
        "config": {
            "model": "reference_gpt (21,064,704 parameters)",
            "global_batch": GLOBAL_BATCH,
            "seq_len": 128,
            "optimizer": "AdamW lr 3e-4 wd 0.1, clipping 1.0",
            "replicate": "2 data-parallel ranks, micro-batch 8, no accumulation",
            "pipeline": "mesh.pp = 2, m micro-batches of 16/m, partition per side",
            "virtual_stages": f"{args.virtual_stages} per rank under interleaved, else 1",
            "stage_measured_s": "per rank: measured forward + backward of its stages' pieces",
            "training_action_s": "per stage (interleaved: per chunk): the median seconds of one "
            "micro-batch's forward (F) and backward (B; zb-h1: its weight pass W, stage -1) in "
            "the measured steps, timed around the engine's calls, waits excluded",
            "measured_action_s": "per stage: the start-up profile's forward and backward of "
            "one micro-batch (the split's input; each piece's least of 3 runs)",
            "world_size": 2,
            "threads_per_rank": args.threads,
            "warmup_steps": args.warmup,
            "measured_steps_per_repeat": args.steps,
            "repeats": args.repeats,
            "order": "each side alone in a fresh process pair, ABBA over repeats",
            "idle": "seconds blocked in the pp doorways (data + control) / step time, per rank",
            "idle_predicted": "schedule simulator on the measured stage times (transfers free)",
            "activations": "peak bytes of tensors saved for backward (parameters excluded)",
        },
        "versions": versions(),
        "machine": machine(),
        "wall_s": time.perf_counter() - t0,
    }
    # benchmarks/pipeline_vs_torch.py keeps its run under "vs_torch" in the same file.
    if args.out.exists() and "vs_torch" in (old := json.loads(args.out.read_text())):
        result["vs_torch"] = old["vs_torch"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"replicate: {rep:.3f} s")
    for side, row in table.items():
        pred = row["idle_predicted"]
        idle = ", ".join(
            f"stage {s} {v:.2f}" + (f" (predicted {pred[s]:.2f})" if s in pred else "")
            for s, v in row["idle_measured"].items()
        )
        peak = row.get("peak_micro_batches", {})
        peaks = ", ".join(f"stage {s} {v:.2f}" for s, v in peak.items())
        print(
            f"{side}: layers split at {row['bounds']}; {row['median_step_s']:.3f} s "
            f"({row['vs_replicate']:.2f} x replicate); idle {idle} (theory "
            f"{row['idle_theory']:.2f}); peak activations (micro-batches) {peaks}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
