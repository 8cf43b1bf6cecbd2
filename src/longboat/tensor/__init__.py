"""Tensor parallelism: layers divided across the ``tp`` ranks by a plan (see ``parallel.py``)."""

from longboat.tensor.parallel import TensorParallel
from longboat.tensor.plans import BUILT_IN, Plan

__all__ = ["BUILT_IN", "Plan", "TensorParallel"]
