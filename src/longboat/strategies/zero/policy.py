"""What a ZeRO stage shards and when it communicates, derived once from the stage number, so
that the strategy's code asks what to do ("are parameters sharded?") instead of comparing stage
numbers.

==============================  =========  =========  =========
                                stage 1    stage 2    stage 3
==============================  =========  =========  =========
optimizer state sharded         yes        yes        yes
gradients sharded               no         yes        yes
parameters sharded              no         no         yes
reduce-scatter                  boundary   every micro-batch
units                           buckets    buckets    modules
all-gather after the step       yes        yes        no (gathered when used)
==============================  =========  =========  =========
"""

from __future__ import annotations

from dataclasses import dataclass

from longboat.observe.memory import model_state


@dataclass(frozen=True)
class ZeroPolicy:
    """One ZeRO stage's choices."""

    stage: int
    #: Only the gradient shard is kept: each micro-batch's gradients are reduce-scattered as
    #: soon as a unit has them, into a shard that accumulates over the step.
    shard_grads: bool
    #: Only the parameter shard is kept between uses: units follow modules, and a unit's
    #: parameters are gathered when its module runs, forward and backward.
    shard_params: bool

    @classmethod
    def of(cls, stage: int) -> ZeroPolicy:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}: use 1, 2 or 3")
        return cls(stage=stage, shard_grads=stage >= 2, shard_params=stage == 3)

    @property
    def units_by_module(self) -> bool:
        return self.shard_params

    @property
    def gather_after_step(self) -> bool:
        """The full flat parameters persist and take every rank's updated shard after a step."""
        return not self.shard_params

    def model_state(self, a: int, n: int, k: int) -> dict[str, int]:
        """This stage's row of [Note: memory formulas] (``observe/memory.py``): what it shards
        is divided among the ``n`` ranks of the shard group."""
        return model_state(
            4 * a / n if self.shard_params else 4 * a,
            4 * a / n if self.shard_grads else 4 * a,
            k * a / n,
        )

    def reduces_now(self, boundary: bool) -> bool:
        """Whether this micro-batch's gradients are reduced (stage 1 only at the boundary)."""
        return self.shard_grads or boundary
