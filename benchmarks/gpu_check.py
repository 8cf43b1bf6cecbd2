"""longboat on a GPU: equivalence, step time and memory, in one run of a few minutes.

What it checks (docs/gpu.md says more):

1. equivalence: every data-parallel strategy (``single``, ``replicate``, ZeRO-1/2/3, hybrid
   sharding) and pipeline and tensor-parallel compositions, each trained by longboat and by a
   plain PyTorch loop that imports nothing from longboat, in fp32, on models with conditionally
   used, frozen and tied parameters: a world of one over NCCL, two and four ranks over gloo
   with CUDA tensors (sharing the GPUs there are), NCCL at two and four ranks where there are as
   many GPUs, and whether NCCL takes two ranks on one GPU;
2. memory: peak ``torch.cuda.max_memory_allocated`` per strategy at a world of one against
   ``longboat plan``'s prediction, and what ``zero.offload_optimizer.device = 'cpu'`` does;
3. step time: longboat's step against the plain one in bf16 on a GPT-2-small-shaped model,
   eager and with ``torch.compile``.

Every case runs in rank processes with a hard time limit, a failure is recorded (its error and
the end of every rank's log) and the run goes on; a global deadline skips what is left. Each part
writes its file as soon as it is done: ``equivalence.json``, ``memory.json``, ``step_time.json``
and ``summary.json`` under ``--out`` (default ``benchmarks/results/gpu``), each with the
machine, versions, commit and config.

Usage::

    python benchmarks/gpu_check.py             # on a machine with an NVIDIA GPU
    python benchmarks/gpu_check.py --dry       # the same code paths on the CPU, tiny sizes,
                                               # into a temporary folder (GPU_CHECK_DRY=1 too)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucheck import equivalence, facts, memory, steptime
from gpucheck.launch import Task, WorldSpec, run_world, write_json

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu"
PARTS = ("equivalence", "memory", "step_time")
# Seconds each part may take at most on a GPU; the global deadline cuts them shorter. A dry run
# checks code paths, not time: only its tasks' own limits and the deadline bound it, so that a
# busy machine makes it slow, not wrong.
CAPS = {"equivalence": 210.0, "memory": 300.0, "step_time": 300.0}
DRY_DEADLINE_S = 900.0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry",
        action="store_true",
        default=os.environ.get("GPU_CHECK_DRY") == "1",
        help="the CPU over gloo, tiny sizes, results in a temporary folder (GPU_CHECK_DRY=1)",
    )
    p.add_argument("--out", type=Path, help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=float(os.environ["GPU_CHECK_DEADLINE_S"])
        if "GPU_CHECK_DEADLINE_S" in os.environ
        else None,
        help="the whole check's limit in seconds; what is left then is skipped "
        f"(default 420, dry {DRY_DEADLINE_S:.0f})",
    )
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated, from " + ",".join(PARTS)
    )
    p.add_argument("--keep-work", action="store_true", help="keep the ranks' logs and files")
    args = p.parse_args(argv)
    if args.deadline_s is None:
        args.deadline_s = DRY_DEADLINE_S if args.dry else 420.0
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if set(args.parts) - set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    return args


class Check:
    """One run: the deadline, the folders, the machine's facts and the log."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry: bool = args.dry
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline_s
        if args.out is not None:
            self.out = args.out
        elif self.dry:  # a dry run never touches the real results
            self.out = Path(tempfile.mkdtemp(prefix="gpu-check-dry-"))
        else:
            self.out = DEFAULT_OUT
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
        self.env = facts.environment(self.dry)

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def part_deadline(self, part: str) -> float:
        if self.dry:
            return self.deadline
        return min(time.monotonic() + CAPS[part], self.deadline)

    def run(self, spec: WorldSpec, tasks: list[Task], deadline: float) -> list[dict[str, Any]]:
        return run_world(spec, tasks, deadline, self.work, dry=self.dry, log=self.say)

    def threads(self, ranks: int) -> int:
        """Intra-op threads per rank: the cores shared out, so that ranks do not thrash each
        other; one in a dry run, which shares its machine with whatever else runs there."""
        return 1 if self.dry else max(1, (os.cpu_count() or 1) // ranks)

    def world_of_one(self, name: str) -> WorldSpec:
        return WorldSpec(name, 1, "none", "cpu" if self.dry else "cuda", self.threads(1))

    def write_file(self, name: str, doc: dict[str, Any]) -> Path:
        """``doc`` as ``NAME.json`` in the results folder, and beside it in
        ``GPU_CHECK_COPY_TO`` when that names a folder (one that a caller collects, so that a
        run cut short still leaves the parts it finished)."""
        path = self.out / f"{name}.json"
        write_json(path, doc)
        copy_to = os.environ.get("GPU_CHECK_COPY_TO")
        if copy_to and Path(copy_to).is_dir() and Path(copy_to).resolve() != self.out.resolve():
            shutil.copy(path, Path(copy_to) / path.name)
        return path

    def write(self, part: str, config: dict[str, Any], results: Any, summary: Any) -> Path:
        return self.write_file(
            part,
            {
                "check": "gpu_check",
                "part": part,
                "environment": self.env,
                "config": config,
                "results": results,
                "summary": summary,
                "wall_time_s": time.monotonic() - self.t0,
                "deadline_s": self.args.deadline_s,
            },
        )


def cause(error: str | None) -> str:
    """The line of an error worth a summary: the first exception line (the root cause of a
    chain), else the first line."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    pattern = r"^(rank \d+: )?[A-Za-z_][\w.]*(Error|Exception|Timeout|Lost|Failure|Exit)\b"
    found = [line for line in lines if re.match(pattern, line)]
    return ((found or lines or [""])[0])[:300]


# -- the parts ---------------------------------------------------------------------------------


def run_equivalence(check: Check) -> dict[str, Any]:
    deadline = check.part_deadline("equivalence")
    gpus = check.env["cuda_device_count"]
    worlds, unrunnable = equivalence.plan(gpus, check.dry)
    cases: list[dict[str, Any]] = []
    for spec, tasks in worlds:
        spec = WorldSpec(
            spec.name,
            spec.size,
            spec.backend,
            spec.device,
            check.threads(spec.size),
            spec.share_gpu,
        )
        for task, rec in zip(tasks, check.run(spec, tasks, deadline), strict=True):
            case = equivalence.case_record(spec, task, rec)
            if case.get("error"):
                case["cause"] = cause(case["error"])
            cases.append(case)
    counts = {s: sum(c["status"] == s for c in cases) for s in ("pass", "fail", "error", "skipped")}
    summary = {**counts, "not_runnable_here": unrunnable}
    config = {
        "tolerance_rel": equivalence.TOL,
        "steps": equivalence.STEPS,
        "global_batch": equivalence.GLOBAL_BATCH,
        "precision": "fp32",
        "worlds": [
            {"name": s.name, "ranks": s.size, "backend": s.backend, "shared_gpu": s.share_gpu}
            for s, _ in worlds
        ],
    }
    check.write("equivalence", config, cases, summary)
    return {"cases": cases, "summary": summary}


def run_memory(check: Check) -> dict[str, Any]:
    tasks = memory.tasks(check.dry)
    recs = check.run(check.world_of_one("memory"), tasks, check.part_deadline("memory"))
    strategies: dict[str, Any] = {}
    offload: dict[str, Any] = {}
    beyond: dict[str, Any] = {}
    for task, rec in zip(tasks, recs, strict=True):
        entry = rec.get("result") or {"status": rec["status"], "error": rec.get("error")}
        if rec["status"] != "ok":
            entry["cause"] = cause(rec.get("error"))
            entry["logs"] = rec.get("logs")
        if task.run.endswith(":offload_cpu"):
            offload = entry
        elif task.run.endswith(":offload_beyond"):
            beyond = entry
        else:
            strategies[task.name] = entry
    ratios = {
        s: e.get("ratio_predicted_over_measured") for s, e in strategies.items() if "strategy" in e
    }
    spaces = [e.get("measured_workspaces") for e in strategies.values() if "strategy" in e]
    summary = {
        "ratio_predicted_over_measured": ratios,
        "workspaces_measured": next((w for w in spaces if w is not None), None),
        "offload_optimizer_cpu": offload.get("outcome"),
        "offload_ratio_predicted_over_measured": {
            "zero-2+cpu": offload.get("ratio_predicted_over_measured_offload"),
            "zero-3+cpu": beyond.get("ratio_predicted_over_measured_offload"),
        },
        "offload_beyond_the_gpu": {
            k: beyond.get(k)
            for k in (
                "outcome",
                "state_over_cap",
                "peak_under_cap",
                "step_ratio_offload_over_in_memory",
            )
        },
    }
    config = {k: v for k, v in tasks[0].args.items() if k != "strategy"}
    config["offload_beyond_the_gpu"] = tasks[-1].args
    config.update(optimizer="AdamW(lr=1e-4)", precision="fp32", world_size=1)
    results = {
        "strategies": strategies,
        "offload_optimizer_cpu": offload,
        "offload_beyond_the_gpu": beyond,
    }
    check.write("memory", config, results, summary)
    return {"results": results, "summary": summary}


def run_step_time(check: Check) -> dict[str, Any]:
    tasks = steptime.tasks(check.dry)
    recs = check.run(check.world_of_one("steptime"), tasks, check.part_deadline("step_time"))
    results: dict[str, Any] = {}
    for task, rec in zip(tasks, recs, strict=True):
        entry = rec.get("result") or {"status": rec["status"], "error": rec.get("error")}
        if rec["status"] != "ok":
            entry["cause"] = cause(rec.get("error"))
            entry["logs"] = rec.get("logs")
        results[task.name] = entry
    summary = {name: r.get("ratio_of_medians") or r.get("status") for name, r in results.items()}
    config = {task.name: task.args for task in tasks}
    check.write("step_time", config, results, summary)
    return {"results": results, "summary": summary}


RUNNERS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "equivalence": run_equivalence,
    "memory": run_memory,
    "step_time": run_step_time,
}


# -- the summary -------------------------------------------------------------------------------


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def summary_lines(check: Check, done: dict[str, dict[str, Any]]) -> list[str]:
    env = check.env
    gpu = ", ".join(f"{g['name']} (driver {g['driver']})" for g in env["gpus"]) or "no GPU"
    lines = [
        f"longboat GPU check{' (dry run, CPU)' if check.dry else ''}: {gpu}; torch {env['torch']}"
        f" (CUDA {env['cuda']}, NCCL {env['nccl']}); commit {env['commit']}",
    ]
    if "equivalence" in done:
        s = done["equivalence"]["summary"]
        lines.append(
            f"equivalence (fp32, {equivalence.TOL:g} relative): {s['pass']} pass, {s['fail']} "
            f"fail, {s['error']} error, {s['skipped']} skipped"
        )
        for c in done["equivalence"]["cases"]:
            head = f"  {c['status']:<7} {c['world']:<16} {c['case']:<22}"
            if c["status"] in ("pass", "fail"):
                extra = (
                    f"loss {c['max_abs_loss_diff']:.1e} (rel {c['max_rel_loss_diff']:.1e}), "
                    f"params {c['max_abs_param_diff']:.1e} (rel {c['max_rel_param_diff']:.1e})"
                )
                if c.get("notes"):
                    extra += f"; {'; '.join(c['notes'])}"
            else:
                extra = c.get("cause") or c.get("error") or ""
            lines.append(f"{head} {extra}")
        for u in s["not_runnable_here"]:
            lines.append(f"  -       {u['world']:<16} not runnable here: {u['why']}")
    if "memory" in done:
        r = done["memory"]["results"]
        lines.append("memory at one rank (fp32, '+bf16' bf16 parameters; planned / measured peak):")
        for name, e in r["strategies"].items():
            if "strategy" in e:
                m = e["measured_peak_bytes"]
                ratio = e["ratio_predicted_over_measured"]
                lines.append(
                    f"  {name:<12} predicted {e['predicted_peak_bytes'] / 2**20:8.1f} MiB  "
                    + (
                        f"measured {m / 2**20:8.1f} MiB  ratio {ratio:.3f}"
                        if m
                        else "measured -  (no CUDA)"
                    )
                )
            else:
                lines.append(f"  {name:<12} {e.get('status')}: {e.get('cause')}")
        spaces = next(
            (e for e in r["strategies"].values() if e.get("measured_workspaces") is not None), None
        )
        if spaces is not None:
            lines.append(
                f"  cuBLAS workspaces (in each peak): planned "
                f"{spaces['predicted']['workspaces'] / 2**20:.1f} MiB, made by a linear layer's "
                f"forward and backward {spaces['measured_workspaces'] / 2**20:.1f} MiB"
            )
        o = r["offload_optimizer_cpu"]
        lines.append(
            f"zero.offload_optimizer.device='cpu': {o.get('outcome') or o.get('status')}"
            + (" (not implemented)" if o.get("not_implemented") else "")
            + (
                f", home {o['home']}, step {o['median_step_s_offload']:.3f} s"
                f" vs {o['median_step_s_in_memory']:.3f} s in device memory, peak "
                f"{_mib(o['peak_bytes_offload'])} vs {_mib(o['peak_bytes_in_memory'])}"
                if o.get("outcome") == "trained"
                else ""
            )
        )
        b = r["offload_beyond_the_gpu"]
        lines.append(
            "zero-3 with offload_param and offload_optimizer 'cpu' beyond the GPU's memory: "
            + str(b.get("outcome") or b.get("status"))
            + (
                f", {b['model']['parameters'] / 1e6:.1f}M parameters, fp32 state "
                f"{_mib(b['fp32_state_bytes'])}"
                + (
                    f" = {b['state_over_cap']:.2f}x the cap of {_mib(b['cap_bytes'])}, peak "
                    f"{_mib(b['peak_bytes_offload'])}"
                    if b.get("cap_bytes")
                    else ""
                )
                + f"; step {b['median_step_s_offload']:.3f} s vs "
                f"{b['median_step_s_in_memory']:.3f} s in device memory "
                f"({b['step_ratio_offload_over_in_memory']:.2f}x)"
                if b.get("outcome") == "trained"
                else f": {b.get('cause')}"
            )
        )
        for label, e in (("zero-2+cpu", o), ("zero-3+cpu", b)):
            planned = e.get("planned_offload")
            if planned and e.get("ratio_predicted_over_measured_offload"):
                lines.append(
                    f"  {label} planned {_mib(planned['peak_bytes'])} on the GPU (host "
                    f"{_mib(planned['host_bytes'])}), measured {_mib(e['peak_bytes_offload'])}: "
                    f"ratio {e['ratio_predicted_over_measured_offload']:.3f}"
                )
    if "step_time" in done:
        lines.append("step time (median; ratio to plain):")
        for name, e in done["step_time"]["results"].items():
            if "median_s" in e:
                parts = [
                    f"{s} {_ms(e['median_s'][s])} ({e['ratio_of_medians'][s]:.3f}x)"
                    for s in e["sides"]
                ]
                lines.append(f"  {name:<9} " + ", ".join(parts))
            else:
                lines.append(f"  {name:<9} {e.get('status')}: {e.get('cause')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    check = Check(args)
    if not check.dry and not check.env["cuda_device_count"]:
        print("no CUDA GPU here: run with --dry (or GPU_CHECK_DRY=1) for the CPU dry run")
        return 2
    check.say(f"results into {check.out}; deadline {args.deadline_s:.0f} s")
    done: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    for part in args.parts:
        if check.deadline - time.monotonic() < 10:
            skipped.append(part)
            check.say(f"{part}: skipped: deadline")
            continue
        check.say(f"{part} ...")
        done[part] = RUNNERS[part](check)
    lines = summary_lines(check, done)
    check.write_file(
        "summary",
        {
            "check": "gpu_check",
            "environment": check.env,
            "parts": {p: done[p]["summary"] for p in done},
            "skipped_parts": {p: "skipped: deadline" for p in skipped},
            "lines": lines,
            "wall_time_s": time.monotonic() - check.t0,
        },
    )
    print("\n".join(lines))
    check.say(f"wrote {', '.join(sorted(p.name for p in check.out.glob('*.json')))} in {check.out}")
    if args.keep_work:
        check.say(f"ranks' files kept in {check.work}")
    else:
        shutil.rmtree(check.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
