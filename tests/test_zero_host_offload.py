"""ZeRO with its master shards and optimizer state in host memory ([Note: host offload] in
``zero/host.py``): on CPU ranks with the home's copies made real ([Note: host copies on CPU]),
the plain PyTorch loop of ``reference.py`` step for step at 1, 2 and 4 ranks, the zoo model,
where the optimizer's tensors live, checkpoints to and from runs without it; on CUDA, the same
beside the GPU with the state pinned."""

from __future__ import annotations

from typing import Any

import dp_helpers
import harness
import offload_helpers
import pytest
import reference
import torch
from torch import nn

import longboat
from longboat.config import load_config
from longboat.config.compositions import Facts, refusal
from longboat.strategies.zero.host import OnHost

UNITS = {1: {"bucket_mb": 0.001}, 2: {"bucket_mb": 0.001}, 3: {"unit_classes": ["Linear"]}}
HOST = {"device": "cpu"}


def _zero(stage: int, offload: bool = True, **units: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, **(units or UNITS[stage])}
    if offload:
        zero["offload_optimizer"] = HOST
    return {"strategy": "zero", "zero": zero}


class _HostRanks:
    """The ``ranks`` fixture with every call's function under ``offload_helpers.host_copies``."""

    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks

    def __call__(self, n: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self.ranks(n, offload_helpers.host_copies, fn, *args, **kwargs)


@pytest.fixture
def host_ranks(ranks: Any) -> _HostRanks:
    return _HostRanks(ranks)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_host_offload_equals_plain_pytorch(host_ranks, stage, world):
    # AdamW with clipping and accumulation: a gradient copied out before it was clipped, or
    # before the last micro-batch landed, and a master copied back before its step would show.
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    dp_helpers.equals_plain_pytorch(host_ranks, world, _zero(stage), recipe, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_offload_zoo_equals_plain_pytorch(host_ranks, stage):
    # a routed (conditionally used), a never-used, a frozen and a tied parameter, BatchNorm
    units = offload_helpers.ZOO_UNITS if stage == 3 else UNITS[stage]
    recipe = reference.Recipe(model="zoo", optimizer="adamw", clip=0.5)
    harness.run_and_compare(
        host_ranks, 2, _zero(stage, **units), recipe, offload_helpers.STEPS, 2, 16, tol=1e-5
    )


def test_host_offload_with_hybrid_sharding_equals_plain_pytorch(host_ranks):
    # The replicas' average changes the gradient shard after its reduction landed: the host
    # copy must be made after it ([Note: host offload]).
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    harness.run_and_compare(
        host_ranks, 4, _zero(2), recipe, 4, 2, 16, tol=1e-5, mesh={"dp_replicate": 2}
    )


def test_host_offload_skips_an_fp16_overflow_as_the_plain_loop_does(host_ranks):
    # Rank 1 alone meets an inf in a gradient it owns after communication, at step 4: every
    # rank skips that step (no master stepped, none copied back changed) and the scale halves.
    recipe = reference.Recipe(
        model="tiny", optimizer="sgd", precision="fp16", loss_scale=2.0**8, loss_scale_window=4
    )
    results, plain = harness.run_and_compare(
        host_ranks, 2, _zero(2), recipe, 6, 1, 16, 4 * 2.0**-11, poison=(4, 1), poison_how="grad"
    )
    assert plain.skipped == [4]
    assert all(r["skipped"] == [4] and r["scales"][3] == 128.0 for r in results)


def _where_state_lives(stage: int) -> dict[str, Any]:
    """Two steps of the zoo model; where its optimizer's parameters and state are."""
    cfg = {**harness.QUIET, **_zero(stage), "batch": {"train_batch_size": 8}}
    if stage == 3:
        cfg["zero"].update(offload_helpers.ZOO_UNITS)
    engine = offload_helpers.train_zoo(cfg, 2)
    home = engine.strategy.home
    shards = [u.shard for u in engine.strategy.units]

    def inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
        a = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == a for b in buffers)

    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    state = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0]
    out = {
        "home": type(home).__name__,
        "pieces": len(pieces),
        "pieces_in_masters": all(inside(p, list(home.masters.values())) for p in pieces),
        "pieces_in_shards": any(inside(p, shards) for p in pieces),
        "grads_in_host": all(
            inside(g, list(home.grads.values()))
            for u in engine.strategy.units
            for g in home.grad_pieces(u)
        ),
        "state": len(state),
        "state_in_shards": any(inside(t, shards) for t in state),
        "state_devices": sorted({t.device.type for t in state}),
        "state_bytes": sum(  # every tensor of the state, its scalar step counts too
            t.untyped_storage().nbytes()
            for st in engine.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        ),
        "shard_bytes": sum(s.nbytes for s in shards),
        "report": engine.memory_report(),
    }
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_the_optimizer_steps_host_buffers_apart_from_the_shards(host_ranks, stage):
    for r in host_ranks(2, _where_state_lives, stage):
        assert r["home"] == "OnHost" and r["pieces"] > 0 and r["state"] > 0
        assert r["pieces_in_masters"] and not r["pieces_in_shards"]
        assert r["grads_in_host"]
        assert not r["state_in_shards"] and r["state_devices"] == ["cpu"]
        # The memory report: the state is not beside the parameters, measured or expected;
        # the host holds it, and a master and a gradient buffer as large as each shard.
        report = r["report"]
        assert report.measured["optimizer_state"] == report.expected["optimizer_state"] == 0
        assert report.on_host == {
            "optimizer_state": r["state_bytes"],
            "master_parameters": r["shard_bytes"],
            "gradient_copies": r["shard_bytes"],
        }
        assert r["state_bytes"] > 0 and "optimizer_state in host memory" in str(report)


def test_on_a_cpu_rank_the_state_stays_with_the_parameters(ranks):
    # [Note: host copies on CPU]: without the switch, no copies and no extra memory
    cfg = {**harness.QUIET, **_zero(2), "batch": {"train_batch_size": 8}}
    (r,) = ranks(1, _where_state_lives_in_memory, cfg)
    assert r == "InMemory"


def _where_state_lives_in_memory(cfg: dict[str, Any]) -> str:
    engine = offload_helpers.train_zoo(cfg, 1)
    name = type(engine.strategy.home).__name__
    report = engine.memory_report()
    assert report.on_host == {} and report.measured["optimizer_state"] > 0
    engine.close()
    return name


def test_checkpoints_move_between_host_offload_and_in_memory_runs(host_ranks, tmp_path):
    offload_helpers.checkpoints_move(
        host_ranks, tmp_path, _zero(2), _zero(1, offload=False), _zero(3, **UNITS[3])
    )


def test_deepspeed_cpu_offload_is_accepted_beside_an_accelerator():
    ds = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    cfg = load_config(ds)
    assert cfg.zero.offload_optimizer.device == "cpu"
    assert refusal(cfg, Facts(device="cuda")) is None
    # the parameters too, without the optimizer: the masters the optimizer steps would have
    # to come back (test_zero_host_param_offload.py has both)
    ds["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    why = refusal(load_config(ds), Facts(device="cuda"))
    assert why is not None and "offload_param.device = 'cpu'" in why
    assert "set zero.offload_optimizer.device = 'cpu'" in why


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@offload_helpers.needs_cuda
@pytest.mark.parametrize("stage", [2, 3])
def test_on_cuda_the_state_is_pinned_on_the_host_and_training_equals_the_plain_loop(stage):
    steps = 6
    torch.manual_seed(1)
    x, y = torch.randn(steps, 8, 8), torch.randn(steps, 8, 4)
    plain = offload_helpers.small_net()  # the plain loop, on the CPU
    opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1)
    want = []
    for i in range(steps):
        loss = nn.functional.mse_loss(plain(x[i]), y[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    model = offload_helpers.small_net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    cfg = {
        **harness.QUIET,
        **_zero(stage),
        "gradient_clipping": 0.5,
        "batch": {"train_batch_size": 8},
    }
    engine = longboat.initialize(model, opt, cfg)
    assert isinstance(engine.strategy.home, OnHost)
    got = []
    for i in range(steps):
        loss = nn.functional.mse_loss(engine(x[i].cuda()), y[i].cuda())
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    state = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert pieces and state
    assert all(t.device.type == "cpu" and t.is_pinned() for t in [*pieces, *state])
    engine.close()
    assert got == pytest.approx(want, rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.device.type == "cuda", name
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def _kernels(optimizer: str, chosen: dict[str, Any]) -> list[tuple[Any, Any]]:
    model = reference.TinyNet()
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = cls(model.parameters(), lr=1e-3, **chosen)
    cfg = {**harness.QUIET, **_zero(2), "batch": {"micro_batch_size": 4}}
    engine = longboat.initialize(model, opt, cfg)
    out = [(g.get("fused"), g.get("foreach")) for g in engine.optimizer.param_groups]
    engine.close()
    return out


@pytest.mark.parametrize(
    ("optimizer", "chosen", "want"),
    [
        ("adamw", {}, (True, None)),  # torch's fused CPU Adam: one pass per element
        ("sgd", {}, (None, True)),  # the CPU's multi-tensor kernels
        ("adamw", {"foreach": False}, (None, False)),  # the user's choice stands
        ("adamw", {"fused": False}, (False, None)),
    ],
)
def test_the_host_steps_with_fast_kernels_unless_the_user_chose(
    host_ranks, optimizer, chosen, want
):
    (got,) = host_ranks(1, _kernels, optimizer, chosen)
    assert got and all(g == want for g in got), got
