"""Tuning a user's own training script: each candidate measured by running the script under it,
as ``longboat run`` would, for a bounded number of steps.

[Note: tuning a script] ``longboat tune train.py -- ARGS`` measures a candidate by running
``longboat run -n WORLD_SIZE train.py ARGS`` with three variables set: the candidate's config in
``LONGBOAT_CONFIG_OVERRIDE`` (set over the script's own config by ``longboat.initialize``:
[Note: config override]), ``LONGBOAT_MAX_STEPS`` = ``--warmup`` + ``--steps`` and
``LONGBOAT_STEP_REPORT_DIR`` (every rank's engine reports its step times there and ends the
process after that many optimizer steps: [Note: step budget]). A step's time is the slowest
rank's; the first ``--warmup`` are left out. The script is the user's whole loop (its data
loading, its loss), so what is measured is what a run of it would do; it must take its batch
sizes from the engine (``engine.loader``, ``engine.batch``) for the micro-batch candidates to
differ. The candidates run one launch after another, so their steps are not paired in rounds
as a bench model's are: the choice is by median step alone.

The planner needs the script's model and one micro-batch of its input: ``--plan-model
module:callable`` names a callable that builds the model, in a module that defines
``example_input(model, micro_batch)`` ([Note: example input] in ``plan/target.py``; the script's
directory is searched first, so ``train:build_model`` names a function in ``train.py`` beside
it, whose training must then sit under ``if __name__ == "__main__":``). Without it the search
is measure-only: nothing is planned or dropped, the candidates are measured in the order of
:func:`~longboat.tune.planning.promising_first` while ``--time`` lasts, and the report says so.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.observe.step_budget import MAX_STEPS_VAR, REPORT_DIR_VAR
from longboat.plan.target import Target

if TYPE_CHECKING:
    from longboat.tune.results import Outcome, TuneSettings
    from longboat.tune.space import Candidate

#: Seconds a launch of the script needs at least (start the ranks, build, a few steps): one is
#: not started with less of ``--time`` left.
MIN_LAUNCH_S = 5.0
Say = Callable[[str, int, int], None]
_UNSET = object()


def script_target(settings: TuneSettings) -> Target | None:
    """The planner's view of the script's model (``--plan-model``), or None: measure-only."""
    if settings.plan_model is None or settings.script is None:
        return None
    from longboat.plan.target import resolve

    where = str(Path(settings.script).resolve().parent)
    if where not in sys.path:
        sys.path.insert(0, where)  # `train:build_model` names train.py beside the script
    return resolve(settings.plan_model)


def script_config(c: Candidate) -> dict[str, Any]:
    """The candidate as the override file says it: its layout in full (``mesh.pp``/``tp`` and
    the schedule even where 1 and the default), so a mesh in the script's own config does not
    survive under a candidate that has none."""
    data = copy.deepcopy(c.mapping)
    data["mesh"] = {"pp": c.layout.pp, "tp": c.layout.tp}
    data["pipeline"] = {"schedule": c.layout.schedule}
    return data


def measure_script(
    chosen: list[Outcome], settings: TuneSettings, deadline: float, say: Say
) -> list[str]:
    """Run the script under each of ``chosen`` while the wall clock is before ``deadline``;
    sets each one's ``measured`` (or its status and why not). Returns those launched."""
    launched = []
    for i, o in enumerate(chosen):
        left = deadline - time.time()
        if left < MIN_LAUNCH_S:
            o.reason = f"time: {max(left, 0):.0f} s of --time left; a launch needs {MIN_LAUNCH_S:g}"
            continue
        assert o.candidate is not None
        say(f"measuring {o.name}", i, len(chosen))
        launched.append(o.name)
        _launch(o, script_config(o.candidate), settings, left)
    return launched


def _launch(o: Outcome, config: dict[str, Any], s: TuneSettings, timeout: float) -> None:
    from longboat.config.override import OVERRIDE_VAR
    from longboat.tune.output import toml_text

    assert s.script is not None
    with tempfile.TemporaryDirectory(prefix="longboat-tune-") as tmp:
        override = Path(tmp) / "candidate.toml"
        override.write_text(toml_text(config))
        env = {
            **os.environ,
            OVERRIDE_VAR: str(override),
            MAX_STEPS_VAR: str(s.warmup + s.steps),
            REPORT_DIR_VAR: tmp,
        }
        cmd = [sys.executable, "-m", "longboat.cli", "run", "-n", str(s.world_size)]
        cmd += [s.script, *s.script_args]
        # A session of its own, so that a run past the deadline is ended with all its ranks.
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            o.status = "failed"
            o.reason = f"time: the run did not take {s.warmup + s.steps} steps within --time"
            return
        reports = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(reports) != s.world_size:
            last = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
            o.status = "failed"
            o.reason = (
                f"the run exited {proc.returncode} with {len(reports)} of {s.world_size} step "
                f"reports: {last[0].strip()}"
            )
            return
        ranks = [json.loads(p.read_text()) for p in reports]
    differ = _not_taken(config, ranks[0].get("config", {}))
    if differ:
        o.status = "failed"
        o.reason = f"the script's run did not take the candidate's config: {differ}"
        return
    o.status = "measured"
    o.measured = _figures(ranks, s.warmup)


def _not_taken(asked: dict[str, Any], ran: dict[str, Any], prefix: str = "") -> str:
    """The first key of ``asked`` whose value the run's config (``ran``, its keys set) does not
    hold, said with both values; empty when the run took them all. Every key of the override
    is set in a run that took it, so a key unset there means the override was not applied."""
    for k, v in asked.items():
        if isinstance(v, dict):
            inner = ran.get(k)
            why = _not_taken(v, inner if isinstance(inner, dict) else {}, f"{prefix}{k}.")
            if why:
                return why
        elif ran.get(k, _UNSET) != v:
            was = "unset" if k not in ran else repr(ran[k])
            return f"{prefix}{k} was {was}, not {v!r}"
    return ""


def _figures(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The report's figures from every rank's step report: each step the slowest rank's."""
    steps = [max(t) for t in zip(*(r["step_times_s"] for r in ranks), strict=True)][warmup:]
    quartiles = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
    losses = [x for r in ranks for x in r["losses"][warmup:] if x is not None]
    return {
        "step_time_median_s": statistics.median(steps),
        "step_time_iqr_s": quartiles[2] - quartiles[0],
        "step_times_s": steps,
        "measured_steps": len(steps),
        "losses": losses,
        "live_peak_bytes_per_rank": None,  # no live-tensor tracker in the user's run
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "rss_increase_bytes_per_rank": None,
        "state_bytes_per_rank": None,
        "paired": False,  # launched one after another: no rounds to pair
    }
