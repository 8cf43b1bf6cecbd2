"""The pool of large CPU blocks a disk home gives torch's allocator ([Note: warm blocks] in
``cpu_pool.py``): blocks reused warm, never more than its cap kept, values untouched by the
reuse, torch's raw allocations (an operator's scratch) freed through it, and the run going on
without it where it cannot be built. The pool is process-wide, so each check runs in a fresh
process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from longboat import cpu_pool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the pool maps its blocks with Linux's mmap"
)

MIB = 1 << 20


def _run(script: str) -> list[str]:
    """``script`` in a fresh process (one thread); what it printed, split."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**clean, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,  # the first build of the extension on this machine
    ).stdout.split()


def test_freed_blocks_are_reused_up_to_the_cap_and_no_more():
    out = _run(
        """
        import torch
        from longboat import cpu_pool
        print(cpu_pool.install(64 << 20, 4 << 20))
        a = torch.empty(4 << 20)  # 16 MiB
        where = a.data_ptr(); del a
        b = torch.empty(4 << 20)
        print(b.data_ptr() == where)  # the kept block, warm
        del b
        c = torch.empty(7 << 19)  # 14 MiB: the 16 MiB block is at most a quarter more
        print(c.data_ptr() == where)
        del c
        d = torch.empty(2 << 20)  # 8 MiB: the 16 MiB block is too large for it
        print(d.data_ptr() != where)
        del d
        many = [torch.empty(4 << 20) for _ in range(10)]
        del many
        s = cpu_pool.stats()
        print(s["kept"], s["cap"], s["hits"])
        small = torch.ones(100)  # below the pool's size: torch's own allocator
        print(float(small.sum()))
        """
    )
    assert out[:4] == ["True", "True", "True", "True"]
    kept, cap, hits = (int(x) for x in out[4:7])
    assert cap == 64 * MIB and kept <= cap and kept >= 48 * MIB  # three 16 MiB blocks and more
    assert hits >= 3  # b, c, and one of the ten
    assert out[7] == "100.0"


def test_training_through_reused_blocks_equals_training_without_the_pool():
    """The same steps of a model with 8 MiB weights, before and after the pool is installed in
    one process: losses and parameters bit for bit (a reused block is not zeroed, as torch's
    ``empty`` promises nothing), and an operator whose scratch torch allocates raw (gelu)."""
    out = _run(
        """
        import torch
        from longboat import cpu_pool

        def train():
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024)
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(4):
                x = torch.randn(64, 1024, generator=g)
                loss = (model(x) - x).square().mean()
                loss.backward(); opt.step(); opt.zero_grad()
                losses.append(loss.item())
            return losses, [p.detach().clone() for p in model.parameters()]

        before, params = train()
        print(cpu_pool.install(64 << 20, 4 << 20))
        after, params2 = train()
        print(before == after, all(torch.equal(a, b) for a, b in zip(params, params2)))
        print(cpu_pool.stats()["hits"] > 0)
        """
    )
    assert out == ["True", "True", "True", "True"]


def test_without_a_build_the_run_goes_on_without_the_pool(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension 'longboat_cpu_pool': no c++ here")

    cpu_pool._extension.cache_clear()
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    try:
        with caplog.at_level(logging.WARNING, logger="longboat"):
            assert cpu_pool.install(64 * MIB, 4 * MIB) is False
        assert cpu_pool.stats() is None
        assert "could not be built (Error building extension" in caplog.text
    finally:
        cpu_pool._extension.cache_clear()


def _pool_asked_for(path: str, fixed: bool) -> list[int]:
    import torch

    import longboat
    from longboat import cpu_pool, heap

    caps: list[int] = []
    real_fix, real_install = heap.fix_mmap_threshold, cpu_pool.install
    heap.fix_mmap_threshold = lambda env=None: fixed  # type: ignore[assignment]
    cpu_pool.install = lambda cap, min_size: caps.append(cap) or True  # type: ignore[assignment]
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters())
        offload = {"device": "disk", "path": path}
        cfg = {"strategy": "zero", "zero": {"stage": 2, "offload_optimizer": offload}}
        longboat.initialize(model, opt, {**cfg, "batch": {"micro_batch_size": 2}}).close()
    finally:
        heap.fix_mmap_threshold, cpu_pool.install = real_fix, real_install  # type: ignore[method-assign]
    return caps


def test_a_disk_home_asks_for_the_pool_where_it_fixed_the_threshold(ranks, tmp_path):
    # two of the largest parameter: the 16 x 8 weight, fp32
    assert ranks(1, _pool_asked_for, str(tmp_path), True) == [[2 * 16 * 8 * 4]]
    # a threshold of the user's (MALLOC_MMAP_THRESHOLD_) leaves the allocator alone too
    assert ranks(1, _pool_asked_for, str(tmp_path), False) == [[]]
