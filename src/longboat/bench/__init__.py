"""``longboat bench``: step time, throughput, scaling and memory of longboat's strategies and
of torch DDP, FSDP2 and DeepSpeed on one model, at world sizes 1..N on this machine.

:mod:`.models` names what is trained, :mod:`.sides` how (one class per strategy or peer),
:mod:`.runner` launches the ranks and measures, :mod:`.report` writes the table, JSON, Markdown
and chart. See ``docs/bench.md``.
"""

from longboat.bench.models import ModelSpec, resolve_model
from longboat.bench.runner import BenchSettings, run_bench

__all__ = ["BenchSettings", "ModelSpec", "resolve_model", "run_bench"]
