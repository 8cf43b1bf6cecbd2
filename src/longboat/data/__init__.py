"""Sharded, epoch-aware data loading: a map-style data set, a stream, or the script's own
``DataLoader``.

Each has its loader and its note: a map-style data set :mod:`~longboat.data.sharded` ([Note:
shards], [Note: worker randomness]), a stream :mod:`~longboat.data.stream` ([Note: streams]), the
script's ``DataLoader`` :mod:`~longboat.data.user` ([Note: your DataLoader]); all share the
:class:`Loader` of :mod:`~longboat.data.loader` (epoch, position, fetch timing, device copy), and
:func:`build_loader` chooses between them.
"""

from longboat.data.build import build_loader
from longboat.data.loader import Loader, Remainder, to_device
from longboat.data.sharded import ShardedLoader, ShardedSampler, make_loader
from longboat.data.stream import StreamLoader, make_stream_loader, shard_stream
from longboat.data.user import UserLoader, dataloader_problem, distributed_sampler, refusal

__all__ = [
    "Loader",
    "Remainder",
    "ShardedLoader",
    "ShardedSampler",
    "StreamLoader",
    "UserLoader",
    "build_loader",
    "dataloader_problem",
    "distributed_sampler",
    "make_loader",
    "make_stream_loader",
    "refusal",
    "shard_stream",
    "to_device",
]
