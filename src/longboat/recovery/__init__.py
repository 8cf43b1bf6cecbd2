"""In-job recovery of replicated state: the survivors of a lost rank carry on, without a restart.

[Note: in-job recovery] With ``recovery.in_job`` (strategy ``replicate``, one rank per replica;
or ``zero`` over hybrid sharding, a shard group per replica: only whole replicas go on, [Note:
membership] in ``membership.py``),
every rank tells the launcher that the job goes on without it ([Note: rank roles] in
``longboat/roles.py``), so torch elastic's agent does not stop the others when one dies
([Note: keeping survivors] in ``launch/survivors.py``). When a collective of the training step
then fails (a peer's connection closed) or times out (``comm.timeout_s``), the engine does not
raise; each survivor:

1. agrees with the others, through the launcher's store, on the next *generation*: its members,
   the step to redo and where the loaders stood at that step's start ([Note: membership] in
   ``membership.py``);
2. leaves the process groups of the old generation (the default group and the topology's) and
   joins a new default group of the members, under a fresh namespace of the same store
   (``longboat/recovery/<generation>/group/``: the old keys name the old ports), ranks
   renumbered in the order of the old ones;
3. builds the mesh and its doorways again at the new size, and hands them to the strategy
   (``regroup``), the monitor and the engine; the batch keeps its micro-batch size and
   accumulation, so the global batch shrinks with the world;
4. drops the failed step's gradients, puts back the model's buffers as they were at the step's
   start (its forwards moved BatchNorm's statistics), skips the step's remaining backwards until
   ``step()``, and re-deals the epoch's remaining samples over the new ranks from the failed
   step's first sample ([Note: regrouped loader] in ``data/sharded.py``); the training loop's
   next batch is the redone step's.

Redoing a step is exact only if no parameter moved in it: the strategy is told to step the
optimizer only once every bucket's reduction arrived (``keep_steps_whole``: no [Note: optimizer
overlap] in ``strategies/replicate.py``).

The state every survivor carries on from is its own, in memory: replicas hold the same
parameters, buffers and optimizer state after every step, and no checkpoint is read. A process
the launcher starts in a dead rank's place is taken in at a step boundary and sent a live
replica's state ([Note: joining a replacement] in ``joining.py``, [Note: what a joiner
receives] in ``transfer.py``). See ``docs/recovery.md`` for what it does not do yet.
"""

from longboat.recovery.membership import Arrival, Membership, RecoveryError, agree

__all__ = ["Arrival", "Membership", "RecoveryError", "agree"]
