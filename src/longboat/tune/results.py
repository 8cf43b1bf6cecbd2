"""What a search is given and what it finds: its settings, each candidate's outcome, the
result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from longboat.tune.verify import DEFAULT_TOP, NOISE_BAND

if TYPE_CHECKING:
    from longboat.tune.cost import Planned, Prediction, Rates
    from longboat.tune.space import Candidate
    from longboat.tune.verify import Verification

#: measured; dropped (over the budget: never launched); not measured (below the --top, or not
#: in the --time left); invalid (refused by the config or by a strategy at setup); unplanned
#: (the planner could not run it: its row says why); failed (its measuring run failed)
Status = Literal["measured", "dropped", "not measured", "invalid", "unplanned", "failed"]


@dataclass(frozen=True)
class TuneSettings:
    """What a search depends on (recorded in full in its report)."""

    model: str = "reference-gpt"
    world_size: int = 2
    global_batch: int | None = None  # default: 8 per rank, as longboat bench's default
    budget: int | None = None  # bytes per rank, as the planner counts them (live tensors)
    time_s: float = 600.0
    top: int | None = DEFAULT_TOP  # None: every candidate that fits (``--top all``)
    seq_len: int = 128
    warmup: int = 1
    steps: int = 5
    micro_sizes: tuple[int, ...] = ()  # default: powers of two up to a rank's share
    buckets_mb: tuple[float, ...] = ()  # default: tune.space.DEFAULT_BUCKETS_MB
    recompute: bool = True  # search activation checkpointing of the model's block classes
    comm_dtypes: tuple[str, ...] = ("fp32",)
    precisions: tuple[str, ...] = ("fp32",)  # keys of tune.space.PRECISIONS
    offload_dir: str | None = None  # adds ZeRO-3 with its state on disk, there
    #: with ``top=None``: the paired-ratio margin of [Note: verifying the choice]
    noise_band: float = NOISE_BAND
    #: pipeline stages and tensor-parallel ranks to try (None: every divisor of the world size
    #: the model can take, and 1: [Note: capabilities] in planning.py)
    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1f1b", "zb-h1")  # pipeline schedules, with pp > 1
    #: a user's script to tune instead of ``model`` ([Note: tuning a script] in script.py),
    #: its arguments, and the planner's view of its model (``package.module:callable``)
    script: str | None = None
    script_args: tuple[str, ...] = ()
    plan_model: str | None = None

    @property
    def batch(self) -> int:
        return self.global_batch or 8 * self.world_size


@dataclass
class Outcome:
    """One combination's fate: its plan, prediction and measurement where it got that far."""

    name: str
    status: Status
    reason: str = ""
    candidate: Candidate | None = None
    mapping: dict[str, Any] = field(default_factory=dict)
    planned: Planned | None = None
    prediction: Prediction | None = None
    rank: int | None = None  # place in the cost model's order (0: predicted fastest)
    measured: dict[str, Any] | None = None  # the bench's figures (see measure.py)


@dataclass
class TuneResult:
    """Everything a search found; ``winner`` is the chosen outcome's name (None: none)."""

    settings: TuneSettings
    model_info: dict[str, Any]
    rates: Rates | None  # None when nothing fitted, so nothing needed predicting
    outcomes: list[Outcome]
    winner: str | None
    reason: str
    launched: list[str]  # the candidates handed to the bench, in rank order
    phases_s: dict[str, float]
    bench: dict[str, Any] | None = None  # the bench's raw result (settings, rows, order)
    #: with ``--top all``: whether the default's choice is the fastest ([Note: verifying the
    #: choice]); None otherwise
    verification: Verification | None = None
    #: what was not searched and why (a layout the model cannot take, a script not planned)
    notes: list[str] = field(default_factory=list)

    def outcome(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.name == name)
