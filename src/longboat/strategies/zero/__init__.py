"""ZeRO stages 1-3 and hybrid sharding: one policy (``policy.py``) over flat units (``flat.py``),
their gathers (``gather.py``), where their state lives (``offload.py``, ``shard_swap.py``), a
model built on the meta device (``init.py``) and what checkpoints see (``state.py``)."""

from longboat.strategies.zero.strategy import Zero

__all__ = ["Zero"]
