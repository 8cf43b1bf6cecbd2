"""The pieces of ``benchmarks/gpu_check.py`` (``make gpu-check``, see docs/gpu.md).

- :mod:`gpucheck.launch`: worlds of rank processes that run a list of tasks, each under a hard
  time limit; a task that fails, hangs or kills its rank is recorded and the world restarts at
  the next one.
- :mod:`gpucheck.rank`: the rank side of that (the process each rank runs).
- :mod:`gpucheck.plain`: the plain PyTorch loops longboat is compared with; like
  ``tests/reference.py`` it imports nothing from longboat.
- :mod:`gpucheck.equivalence`: the cases (strategy, mesh, world, backend), longboat's side of
  each on every rank, and the comparison with the plain loop on rank 0.
- :mod:`gpucheck.steptime`: longboat's step against the plain loop, eager and compiled.
- :mod:`gpucheck.memory`: peak accelerator memory per strategy against ``longboat plan``, and
  what ZeRO's optimizer offload to CPU memory does beside an accelerator.
- :mod:`gpucheck.facts`: the machine and versions a result is recorded with.
"""
