"""``longboat tune``: the fastest configuration that fits a memory budget per rank, found by the
planner and confirmed by measurement (see ``docs/tune.md``).

:mod:`.space` builds the candidates (real longboat configs), :mod:`.machine` measures this
machine's rates, :mod:`.cost` predicts a step's time, :mod:`.search` plans, prunes, ranks and
measures, :mod:`.verify` checks the default's choice when every candidate that fits was measured
(``--top all``), :mod:`.output` writes the chosen config (TOML and DeepSpeed JSON),
:mod:`.report` the table and JSON, :mod:`.command` checks the flags and runs it with progress.
"""

from longboat.tune.cost import Planned, Prediction, Rates, Work, predict
from longboat.tune.layout import Layout
from longboat.tune.search import Outcome, TuneResult, TuneSettings, search
from longboat.tune.space import Candidate, Invalid, Space, build_space

__all__ = [
    "Candidate",
    "Invalid",
    "Layout",
    "Outcome",
    "Planned",
    "Prediction",
    "Rates",
    "Space",
    "TuneResult",
    "TuneSettings",
    "Work",
    "build_space",
    "predict",
    "search",
]
