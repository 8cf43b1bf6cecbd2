"""Whether the default search's choice is the fastest that fits, when every fitting candidate
is measured (``longboat tune --top all``).

[Note: verifying the choice] One ``--top all`` run measures every candidate that fits, side by
side in the same rounds. From it this module answers what a run with the default ``--top``
(:data:`DEFAULT_TOP`) would have chosen, and whether anything that fits is faster:

- *the default's choice* is the measured candidate with the lowest median step among the
  ``DEFAULT_TOP`` the cost model put first (passing over one whose measured live-tensor peak is
  over the budget, as the search does): what the default run measures, in the same rounds;
- each other measured candidate is compared with it by the *paired ratio*: the median over
  rounds of its step over the choice's step in the same round. A round's steps run moments
  apart, so the ratio cancels what else the machine does; medians of separate runs on this
  machine move by about 8% between quiet runs, paired ratios far less;
- a candidate is *faster* than the choice when its paired ratio is below ``1 - band``
  (``--noise-band``, default :data:`NOISE_BAND`): faster by more than the noise band. The choice
  is *the fastest within the noise* when no candidate that fits is faster. A candidate faster
  by less than the band is named as within the noise, not as faster.

The verdict is only as complete as the measurement: candidates left out by ``--time`` or by a
measured peak over the budget are counted and named, and ``all_measured`` says whether every
candidate the planner let through was measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: The ``--top`` of a default search, whose choice a full measurement checks.
DEFAULT_TOP = 3
#: Paired-ratio margin within which two candidates are not told apart (5%: under the 8% that
#: quiet medians move between runs on the reference machine, above the spread of paired ratios).
NOISE_BAND = 0.05


class _Measured(Protocol):
    name: str
    rank: int | None
    measured: dict[str, Any] | None


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of ``a``'s step over ``b``'s in the same round: each round's
    steps were moments apart, so this cancels what the machine was doing at the time."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Verification:
    """The answer of [Note: verifying the choice]."""

    top: int  # the default --top whose choice is checked
    band: float
    choice: str | None  # what a default search would choose (None: nothing measured)
    fastest: str | None  # the lowest measured median that fits
    choice_is_fastest: bool  # within the noise band, in paired rounds
    all_measured: bool  # every candidate the planner let through was measured
    faster: list[str] = field(default_factory=list)  # faster than the choice beyond the band
    within_noise: list[str] = field(default_factory=list)  # faster, but within the band
    #: per measured candidate that fits: median step, paired ratio to the choice, verdict
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: planned to fit but not measured, or measured over the budget: each with why
    left_out: list[str] = field(default_factory=list)
    verdict: str = ""

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def verify(
    fitting: Sequence[_Measured],
    eligible: set[str],
    top: int = DEFAULT_TOP,
    band: float = NOISE_BAND,
    reasons: dict[str, str] | None = None,
) -> Verification:
    """Check the default's choice against every measured candidate of ``fitting`` (the
    candidates the planner let through, with their cost-model ``rank``); ``eligible``: the
    measured ones whose measured peak is within the budget (what a search may choose)."""
    reasons = reasons or {}
    measured = [o for o in fitting if o.measured is not None and o.name in eligible]
    left_out = [
        f"{o.name}: {reasons.get(o.name) or 'not measured'}" for o in fitting if o not in measured
    ]
    all_measured = len(measured) == len(fitting)
    if not measured:
        return Verification(
            top, band, None, None, False, all_measured, left_out=left_out,
            verdict="nothing that fits was measured",
        )  # fmt: skip

    def median(o: _Measured) -> float:
        assert o.measured is not None
        return float(o.measured["step_time_median_s"])

    first = [o for o in measured if o.rank is not None and o.rank < top]
    fastest = min(measured, key=median)
    if not first:  # none of the default's candidates could be measured or fits
        return Verification(
            top, band, None, fastest.name, False, all_measured, left_out=left_out,
            verdict=f"none of the cost model's first {top} was measured within the budget",
        )  # fmt: skip
    choice = min(first, key=median)
    assert choice.measured is not None
    base = choice.measured["step_times_s"]
    rows, faster, close = [], [], []
    for o in sorted(measured, key=median):
        assert o.measured is not None
        ratio = paired_ratio(o.measured["step_times_s"], base)
        if o is choice:
            verdict = "the default's choice"
        elif ratio < 1 - band:
            verdict = f"faster by more than the {band:.0%} band"
            faster.append(o.name)
        elif ratio < 1:
            verdict = f"faster within the {band:.0%} band"
            close.append(o.name)
        else:
            verdict = "slower" if ratio > 1 + band else "slower within the band"
        rows.append(
            {
                "candidate": o.name,
                "rank_by_cost_model": o.rank,
                "step_time_median_s": median(o),
                "paired_ratio_to_choice": ratio,
                "verdict": verdict,
            }
        )
    ok = not faster
    text = (
        f"{choice.name}, the choice of --top {top}, is "
        + ("the fastest" if ok else "not the fastest")
        + f" of the {len(measured)} measured candidates that fit, within a {band:.0%} band in "
        "paired rounds"
    )
    if faster:
        text += f"; faster beyond it: {', '.join(faster)}"
    if close:
        text += f"; faster within it: {', '.join(close)}"
    if not all_measured:
        text += f"; {len(left_out)} candidate(s) that fit were not measured"
    return Verification(
        top=top,
        band=band,
        choice=choice.name,
        fastest=fastest.name,
        choice_is_fastest=ok,
        all_measured=all_measured,
        faster=faster,
        within_noise=close,
        rows=rows,
        left_out=left_out,
        verdict=text,
    )
