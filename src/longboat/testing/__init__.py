"""Run a function on N gloo ranks over 127.0.0.1, for tests.

Starting processes and importing torch is what makes multi-rank tests slow (seconds per
process on a small machine), so :class:`RankPool` starts its workers once, initialises one
gloo process group, and then reuses both for every call::

    with RankPool(2) as pool:
        sums = pool.run(all_reduce_rank)   # one result per rank, in rank order

Rules for what is run, all following from workers being separate, long-lived processes:

* ``fn`` and its arguments are pickled by reference, so ``fn`` must be a module-level
  function of an importable module (a test module is fine: the worker gets the parent's
  ``sys.path`` with every call). Lambdas and nested functions are rejected before anything
  is sent.
* Results are pickled back: return CPU tensors, plain numbers or lists, not CUDA tensors or
  open handles.
* The process group is shared between calls, so a call must leave no collective pending
  (every rank issues the same collectives and waits for async ones), and must not destroy
  the process group. Module globals and RNG state in the workers also persist across calls.
* Inside a call, ``torch.distributed.get_rank()`` / ``get_world_size()`` say where it runs
  and :func:`in_rank_pool` says that it runs in a pool at all.

When any rank raises, or not every rank answers within the timeout, :meth:`RankPool.run`
raises :class:`RankFailure` and replaces all workers: ranks that did not fail may be stuck
in a collective that will never complete, and the process group cannot be trusted after that.

Workers are started with the 'spawn' method, which re-imports the parent's ``__main__``: a
script (not pytest) that creates a pool must do so under ``if __name__ == "__main__":``.
A pool is meant for one thread at a time.
"""

from longboat.testing.common import POOL_ENV_VAR, RankFailure, in_rank_pool
from longboat.testing.pool import RankPool, RankPools

__all__ = ["POOL_ENV_VAR", "RankFailure", "RankPool", "RankPools", "in_rank_pool"]
