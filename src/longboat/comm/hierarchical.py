"""A hierarchical all-reduce: a :class:`~longboat.comm.protocol.Comm` over one group of ranks
that reduces in two levels, through a doorway within each node and one across nodes.

[Note: hierarchical all-reduce] A group spread over ``N`` nodes of ``L`` of its ranks each
(``comm.hierarchical``; the layout from :func:`node_layout`) sums a tensor of ``n`` elements in
three steps, each through a doorway of its own (so the desync check, the comm log and hang
reports see every level):

1. a reduce-scatter within the node (``L`` ranks): each rank keeps the node's sum of one
   ``n / L`` chunk;
2. an all-reduce of that chunk across nodes, among the ranks of the same local position
   (``N`` ranks, one per node): each chunk now holds the sum over the whole group;
3. an all-gather within the node puts the chunks back together on every rank.

Across nodes each rank then sends ``2 (N-1)/N * n/L`` elements instead of a flat ring's
``2 (LN-1)/(LN) * n`` going through the slowest link: the inter-node links carry ``1/L`` of the
flat ring's bytes, and every rank of a node uses its own link (NIC) at once. It is the
bandwidth-optimal form of "reduce within the node, all-reduce across nodes, broadcast within"
(a reduce to one local root would leave the other ranks' links idle).

Step 1 is launched when the all-reduce is. Step 2 is launched when the next all-reduce through
the same doorway is (after waiting for this one's step 1, which the node's group finishes before
the next one's anyway), so the inter-node step of bucket ``k`` overlaps the backward that
produces bucket ``k + 1``; at the latest it is launched in the handle's ``wait``, which then runs
step 3. Launches and waits come in program order, the same on every rank, so every level's
doorway sees its collectives in the same order everywhere ([Note: launch order] in
``comm/order.py``); advancing a step when the previous one happens to finish would depend on
timing and could pair different buckets across ranks.

Only sums (and averages) are split: ``max``/``min`` all-reduces and every other operation go
through the flat doorway of the whole group. A reduce-scatter is refused: its chunks belong to
positions in the flat group, which the two levels would place differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from longboat.comm.protocol import Comm, Handle
from longboat.comm.protocol import Done as _Done
from longboat.comm.trace import CallRecord
from longboat.config.errors import ConfigError


def node_layout(
    ranks: Sequence[int], ranks_per_node: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The intra-node and inter-node groups of the group ``ranks`` (global ranks) when node
    ``i`` holds global ranks ``i * ranks_per_node .. (i+1) * ranks_per_node - 1``: per node,
    the group's ranks on it (in node order), and per local position, the ranks at that position
    on every node. Raises :class:`ConfigError` naming the sizes when the nodes hold different
    numbers of the group's ranks (the two levels would not cover the group evenly)."""
    if ranks_per_node < 1:
        raise ConfigError(f"comm.ranks_per_node = {ranks_per_node}: a node holds at least one rank")
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // ranks_per_node, []).append(r)
    intra = [sorted(v) for _, v in sorted(nodes.items())]
    sizes = {len(v) for v in intra}
    if len(sizes) > 1:
        held = ", ".join(f"node {n} holds {len(v)}" for n, v in sorted(nodes.items()))
        raise ConfigError(
            f"comm.hierarchical = true: the data-parallel group {list(ranks)} spreads unevenly "
            f"over nodes of {ranks_per_node} ranks ({held}); the hierarchical all-reduce needs "
            "the same number of the group's ranks on every node. Choose a mesh or "
            "comm.ranks_per_node that divides the group evenly, or set comm.hierarchical = false"
        )
    per_node = len(intra[0])
    inter = [[node[i] for node in intra] for i in range(per_node)]
    return intra, inter


class _Levels:
    """One hierarchical all-reduce in flight: step 1 launched, steps 2 and 3 in ``wait``."""

    __slots__ = ("_buf", "_first", "_owner", "_part", "_second", "_tag", "_tensor")

    def __init__(self, owner: Hierarchical, tensor: torch.Tensor, tag: str) -> None:
        self._owner, self._tensor, self._tag = owner, tensor, tag
        flat = tensor.view(-1)
        size = owner.intra.world_size
        chunk = -(-flat.numel() // size)
        if chunk * size == flat.numel():
            self._buf = flat  # reduced in place: step 3 writes every element back
        else:  # padded to a multiple of the node's ranks, so every chunk has the same size
            self._buf = torch.zeros(chunk * size, dtype=tensor.dtype, device=tensor.device)
            self._buf[: flat.numel()].copy_(flat)
        self._part = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
        self._second: Handle | None = None
        self._first: Handle | None = owner.intra.reduce_scatter(
            self._part, self._buf, async_op=True, tag=f"{tag} (within the node)", scratch=True
        )

    def is_completed(self) -> bool:
        return self._first is None and self._second is None

    def across(self) -> None:
        """Step 2: once step 1 is over, launch the all-reduce across nodes (once)."""
        if self._first is None:
            return
        first, self._first = self._first, None
        first.wait()
        self._second = self._owner.inter.all_reduce(
            self._part, async_op=True, tag=f"{self._tag} (across nodes)"
        )

    def wait(self) -> bool:
        self.across()
        if self._second is None:
            return True
        second, self._second = self._second, None
        second.wait()
        self._owner.intra.all_gather(self._buf, self._part, tag=f"{self._tag} (within the node)")
        flat = self._tensor.view(-1)
        if self._buf.data_ptr() != flat.data_ptr():
            flat.copy_(self._buf[: flat.numel()])
        return True


class Hierarchical:
    """The :class:`~longboat.comm.protocol.Comm` of a group whose sums go through ``intra``
    (this rank's node's part of the group) and ``inter`` (the same local position on every
    node): [Note: hierarchical all-reduce]. ``flat`` is the whole group's doorway, for what is
    not split. The three doorways belong to the topology, which closes them."""

    def __init__(self, flat: Comm, intra: Comm, inter: Comm) -> None:
        if intra.world_size * inter.world_size != flat.world_size:
            raise ValueError(
                f"the node levels ({intra.world_size} x {inter.world_size} ranks) do not cover "
                f"the group of {flat.world_size}"
            )
        self.flat, self.intra, self.inter = flat, intra, inter
        self.rank = flat.rank
        self.world_size = flat.world_size
        self.active = flat.active
        self.seq = 0
        self.last: CallRecord | None = None
        self.blocked_seconds = 0.0  # counted by the level doorways, which the topology sums
        self.timeout_s = flat.timeout_s
        self.desync_check = flat.desync_check
        self.log = flat.log
        self._last: _Levels | None = None  # the last all-reduce launched

    def global_rank(self, group_rank: int) -> int:
        return self.flat.global_rank(group_rank)

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Sum (or average) ``tensor`` in place over the group in two levels; ``max``/``min``
        through the flat doorway."""
        if not self.active:
            return _Done()
        if op not in ("sum", "avg"):
            return self.flat.all_reduce(tensor, op=op, async_op=async_op, tag=tag)
        if not tensor.is_contiguous():
            raise ValueError("a hierarchical all-reduce needs a contiguous tensor")
        if op == "avg":
            if not tensor.is_floating_point():
                raise TypeError(f"all_reduce(op='avg') needs a floating tensor, got {tensor.dtype}")
            tensor.div_(self.world_size)  # as the flat doorway: divide first, then sum
        self.seq += 1
        levels = _Levels(self, tensor, tag)
        if self._last is not None:  # its step 2 ([Note: hierarchical all-reduce])
            self._last.across()
        self._last = levels
        if async_op:
            return levels
        levels.wait()
        return _Done()

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        tag: str = "",
        scratch: bool = False,
    ) -> Handle:
        # A config asking for it is refused on loading (rule 'hierarchical-zero' of [Note:
        # compositions]); this guards a strategy that would reduce-scatter through it anyway.
        raise ConfigError(
            "comm.hierarchical = true makes data-parallel all-reduces hierarchical, but this "
            "strategy reduces gradients by reduce-scatter (ZeRO), which has no hierarchical "
            "form here: set comm.hierarchical = false (comm.groups still spreads its "
            "reductions), or use strategy 'replicate'"
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        return self.flat.all_gather(output, input, async_op=async_op, tag=tag)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        return self.flat.all_to_all(output, input, async_op=async_op, tag=tag)

    def count_replaced(self, op: str, nbytes: int) -> None:
        self.flat.count_replaced(op, nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.flat.broadcast(tensor, src)

    def barrier(self) -> None:
        self.flat.barrier()

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: str = "") -> Handle:
        return self.flat.send(tensor, dst, async_op=async_op, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: str = "") -> Handle:
        return self.flat.recv(tensor, src, async_op=async_op, tag=tag)

    def log_summary(self) -> list[dict[str, Any]]:
        """The rows of both levels' comm logs."""
        return [*self.intra.log_summary(), *self.inter.log_summary()]

    def close(self) -> None:
        pass  # the level doorways are the topology's
