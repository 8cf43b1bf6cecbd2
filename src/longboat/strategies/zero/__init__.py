"""ZeRO stages 1-3 and hybrid sharding: one policy (``policy.py``) over flat units (``flat.py``,
chosen and built in ``units.py``), their reductions (``reduce.py``) and gathers (``gather.py``),
where their state lives (``homes.py``: memory, or disk through ``offload.py`` and
``shard_swap.py``), the optimizer step (``step.py``), a joined rank's replay (``shadow.py``), a
model built on the meta device (``init.py``) and what checkpoints see (``state.py``)."""

from longboat.strategies.zero.strategy import Zero

__all__ = ["Zero"]
