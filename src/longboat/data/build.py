"""The one place that chooses the loader for what a script hands :meth:`Engine.loader`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from longboat.config.errors import ConfigError
from longboat.config.sections import DataConfig
from longboat.data.loader import Loader, Remainder
from longboat.data.sharded import make_loader
from longboat.data.stream import make_stream_loader
from longboat.data.user import UserLoader, dataloader_problem, refusal

log = logging.getLogger("longboat")


class _LoaderArgs(TypedDict):
    """What :func:`make_loader` and :func:`make_stream_loader` both take, besides the data set
    and ``shuffle``."""

    rank: int
    world_size: int
    micro_batch_size: int
    train_batch_size: int
    seed: int
    remainder: Remainder
    collate_fn: Callable[..., Any] | None
    announce: bool
    device: torch.device | None
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool


def build_loader(
    source: Dataset[Any] | DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    per_step: bool,
    train_batch_size: int,
    data: DataConfig,
    shuffle: bool | None,
    seed: int,
    collate_fn: Callable[..., Any] | None,
    announce: bool,
    device: torch.device | None,
    agree: Callable[[str | None], list[Any]],
) -> Loader:
    """The loader :meth:`Engine.loader` returns for ``source``: a map-style data set's
    (:class:`ShardedLoader`), a stream's (:class:`StreamLoader`), or the script's own
    ``DataLoader`` (:class:`UserLoader`) once ``agree`` (every rank's verdict, in rank order,
    on every rank) says no rank has a problem with it."""
    if isinstance(source, DataLoader):
        why = refusal(
            agree(
                dataloader_problem(
                    source,
                    rank=rank,
                    world_size=world_size,
                    batch_size=batch_size,
                    per_step=per_step,
                    shuffle=shuffle,
                    collate_fn=collate_fn,
                )
            )
        )
        if why is not None:
            raise ConfigError(why)
        if announce:
            log.info(
                "loader: the script's DataLoader with its DistributedSampler (num_replicas=%d): "
                "its batches as they come, set_epoch before each epoch",
                world_size,
            )
        return UserLoader(source, batch_size, device)
    common: _LoaderArgs = {
        "rank": rank,
        "world_size": world_size,
        "micro_batch_size": batch_size,
        "train_batch_size": train_batch_size,
        "seed": seed,
        "remainder": data.remainder,
        "collate_fn": collate_fn,
        "announce": announce,
        "device": device,
        "num_workers": data.num_workers,
        "prefetch_factor": data.prefetch_factor,
        "persistent_workers": data.persistent_workers,
    }
    if isinstance(source, IterableDataset):
        return make_stream_loader(source, shuffle=shuffle, **common)
    return make_loader(source, shuffle=data.shuffle if shuffle is None else shuffle, **common)
