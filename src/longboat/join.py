"""Uneven inputs: data-parallel ranks that hold different numbers of batches.

[Note: joining] With ``data.remainder = 'join'`` a rank may run out of batches before the others
(the last step of an epoch of ``engine.loader``, or an iterable of its own through
``engine.join``). Without help it would leave the loop while the others wait in their next
gradient collective for ever (torch DDP's hang, which ``torch.distributed.algorithms.Join``
cures for DDP alone). Here, under every data-parallel strategy that can shadow:

* **The vote.** Before each micro-batch every data-parallel rank says whether it has one: one
  all-reduce of a one-hot vector (one int per rank) on the ``dp`` control plane. Every rank then
  knows who has a micro-batch, so every rank knows at once when all are done and all leave the
  loop together; a rank that ran out keeps voting "no" and shadows until then.
* **The average over the contributors.** The count is known before the backward, so a
  contributing rank scales its loss by ``dp / count`` (``loss / (accumulation x count / dp)``):
  the strategy's usual average over all ``dp`` ranks, with zeros from those without a batch,
  is then the sum over the ``count`` ranks that had one, divided by ``count``. No strategy's
  reduction changes, and with every rank contributing the loss is divided exactly as before.
  Clipping, fp16's overflow check and the optimizer see the reduced (averaged) gradients, as
  always. Accumulation stays per micro-batch: the step's gradient is the mean, over its
  ``accumulation`` micro-batches, of each micro-batch's average over its contributors (a
  micro-batch no rank had contributes zero).
* **The shadow.** A rank without a batch runs the engine's backward bookkeeping without a
  forward or an autograd backward: ``before_backward``, the strategy's ``shadow()``, then
  ``after_backward``, and ``step()`` at the boundary, so every collective of the step (the
  gradient reductions, the overflow flag, the clipping norm, ZeRO's usage vote and gathers after
  the optimizer step, monitor events) is issued as on the others. What each strategy's
  ``shadow()`` does:

  - replicate, ZeRO-1 and ZeRO-2: nothing more. Their ``after_backward`` already launches, in
    order, every bucket or unit the backward did not complete, with zeros for gradients this
    rank does not have (or what it accumulated on earlier micro-batches of the step, which are
    real contributions); the usage flags and vote say it used nothing, so a parameter only it
    would have used stays ``grad = None`` as in plain PyTorch.
  - ZeRO-3: replays the gathers and reduce-scatters of its last real micro-batch ([Note: stage-3
    shadow] in ``strategies/zero/shadow.py``).
  - every strategy: the buffers' broadcast after the backward ([Note: buffers]) happens on the
    joined rank too, and its source is the lowest rank that had a batch in this micro-batch (rank
    0's, as always, while rank 0 has batches): a rank without a forward has nothing to give.

  The optimizer step on a joined rank is the ordinary one: it steps its ZeRO shard with the
  reduced gradients (and its optimizer state with it), and replicate's ranks stay identical.
* **The end.** When the vote says no rank has a batch, the loop ends on every rank; if that
  happens inside an accumulation, every rank first shadows the step's remaining micro-batches
  and takes the step, so no sample's gradient is lost.

What the loop body may do: fetch a batch, ``engine(x)``, ``engine.backward(loss)``,
``engine.step()`` (after every backward, as the README's loop does), and anything that issues no
collective. A joined rank does not run the body, so collectives of the script's own between
batches (``should_stop``, ``save_checkpoint``, ``reduce_metrics``, ``gathered_parameters``) would
meet the shadow's collectives: call them after the loop, where every rank is in step again. (With
the desync check on, one on the control plane, where the vote goes, fails at once on every rank,
naming the vote; anything else fails at the latest when ``comm.timeout_s`` is over.) Leaving the
loop early (``break``, an exception) shadows nothing: a ``break`` is safe when every rank takes it
at the same step before any rank has run out; otherwise bound the iterable instead. Refused by the
config: pipelines, tensor parallelism, ``sync_batchnorm`` and parameter servers (the reasons are
in ``Config``'s check).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from longboat.comm.protocol import Comm

log = logging.getLogger("longboat")

#: What a timeout in a gradient collective may mean when ranks hold different numbers of
#: batches and the policy is not on.
UNEVEN_HINT = (
    "if a rank that did not arrive ran out of batches (ranks holding different numbers of "
    "batches), set data.remainder = 'join' so that it shadows the others' collectives until "
    "every rank is done"
)


@dataclass(frozen=True)
class Turn:
    """One micro-batch's vote: which data-parallel ranks have a batch for it."""

    have: tuple[bool, ...]

    @property
    def count(self) -> int:
        """How many ranks contribute to this micro-batch."""
        return sum(self.have)

    @property
    def first(self) -> int | None:
        """The lowest rank with a batch (whose buffers count), or None."""
        return next((r for r, h in enumerate(self.have) if h), None)


class JoinVote:
    """The per-micro-batch vote of [Note: joining] over the ``dp`` control plane, and what it
    says in the log when a rank runs out first."""

    def __init__(self, control: Comm, accumulation: int) -> None:
        self.control = control
        self.accumulation = accumulation
        self._mine = torch.zeros(control.world_size, dtype=torch.int64)
        self._before: tuple[bool, ...] = ()
        self._told: set[int] = set()

    def begin(self) -> None:
        """A new loop: every rank is taken to have batches until it says otherwise."""
        self._before = (True,) * self.control.world_size
        self._told = set()

    def vote(self, have: bool, global_step: int, micro: int) -> Turn:
        """Every rank's answer for the next micro-batch (collective over ``dp``); ``micro`` is
        its index within the current step (``global_step`` steps done)."""
        mine = self._mine
        mine.zero_()
        mine[self.control.rank] = int(have)
        self.control.all_reduce(mine, tag="join: which ranks have a batch")
        turn = Turn(tuple(bool(v) for v in mine.tolist()))
        if turn.count:
            for r, (was, now) in enumerate(zip(self._before, turn.have, strict=True)):
                if was and not now and r not in self._told:
                    self._told.add(r)
                    log.info(
                        "rank %d ran out of batches %s; it shadows the others' collectives with "
                        "zero contributions until all are done",
                        r,
                        _when(global_step, micro, self.accumulation),
                    )
        self._before = turn.have
        return turn


def _when(global_step: int, micro: int, accumulation: int) -> str:
    """When a rank ran out, said from the step count."""
    if micro == 0:
        return f"after step {global_step}" if global_step else "before the first step"
    return f"in step {global_step + 1}, after {micro} of its {accumulation} micro-batches"
