"""ZeRO-3 with its parameter and gradient shards on disk ([Note: parameter offload]) and a model
built on the meta device ([Note: deferred init]): the plain PyTorch loop step for step,
what lives where between steps, checkpoints to and from runs without offload, and what is
refused."""

from __future__ import annotations

import re
from pathlib import Path

import harness
import offload_helpers
import pytest
import reference
import torch

from longboat.config import ConfigError, load_config

UNITS = offload_helpers.ZOO_UNITS  # the zoo model's, as test_offload's stage 3 (shared)
GPT_ARGS = {"vocab_size": 128, "d_model": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16}


def _zero3(
    path: Path, optimizer_too: bool = True, buffer_count: int = 2, units: dict = UNITS
) -> dict:
    disk = offload_helpers.disk(path, buffer_count)
    zero: dict = {"stage": 3, **units, "offload_param": disk}
    if optimizer_too:
        zero["offload_optimizer"] = disk
    return {"strategy": "zero", "zero": zero}


@pytest.mark.parametrize(
    ("world", "model", "optimizer_too"),
    [(1, "zoo", True), (2, "zoo", True), (2, "tied", False)],
    ids=["1-zoo", "2-zoo", "2-tied-params-only"],
)
def test_parameters_and_gradients_on_disk_equal_plain_pytorch(
    ranks, tmp_path, world, model, optimizer_too
):
    # AdamW with clipping (its norm from the squares kept as gradients were written, its factor
    # applied as each gradient comes back) and accumulation (each micro-batch's reduction added
    # to what the gradient file holds); the zoo model has a routed, a never-used and a frozen
    # parameter and BatchNorm buffers, the tied one a weight used twice.
    recipe = reference.Recipe(model=model, optimizer="adamw", clip=0.5)
    # the tied model's Linear layers as units: the tied weight sits in one of them
    units = UNITS if model == "zoo" else {"unit_min_params": 50}
    strategy = _zero3(tmp_path, optimizer_too, world, units)
    offload_helpers.equals_plain_pytorch(ranks, world, strategy, recipe, tmp_path)


def _between_steps(cfg: dict, steps: int) -> dict:
    """Train ``steps`` steps; what memory and disk hold before close()."""
    engine = offload_helpers.train_zoo(cfg, steps)
    report = engine.memory_report()
    units = engine.strategy.units
    path = Path(cfg["zero"].get("offload_param", {}).get("path", "/nonexistent"))
    out = {
        "measured": report.measured,
        "expected": report.expected,
        "on_disk": report.on_disk,
        "shard_bytes": sum(u.shard_numel * 4 for u in units),
        "units": len(units),
        "files": sorted(f.name for f in offload_helpers.swap_files(path)),
        "text": str(report),
        # element-wise state (AdamW's moments); the step counts stay in memory with offload
        "moments": sum(
            t.numel() * t.element_size()
            for st in engine.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ),
    }
    engine.close()
    return out


def test_between_steps_nothing_of_the_model_state_is_in_memory(ranks, tmp_path):
    cfg = {**harness.QUIET, **_zero3(tmp_path), "batch": {"train_batch_size": 8}}
    in_memory = {**cfg, "zero": {"stage": 3, **UNITS}}
    held = ranks(2, _between_steps, in_memory, 3)
    for rank, r in enumerate(ranks(2, _between_steps, cfg, 3)):
        for category in ("parameters", "gradients", "optimizer_state", "communication_buffers"):
            assert r["measured"][category] == 0 == r["expected"][category], (category, r)
        # each parameter shard and gradient shard in a file, two AdamW moments in another
        assert r["on_disk"] == {
            "parameters": r["shard_bytes"],
            "gradients": r["shard_bytes"],
            "optimizer_state": held[rank]["moments"],
        }
        assert held[rank]["measured"]["parameters"] == r["shard_bytes"]
        mine = [f for f in r["files"] if f.startswith(f"rank{rank}.")]
        assert len([f for f in mine if f.endswith(".param.bin")]) == r["units"]
        assert len([f for f in mine if f.endswith(".grad.bin")]) == r["units"]
        assert "parameters on disk" in r["text"]
    assert not offload_helpers.swap_files(tmp_path)


def test_checkpoints_move_between_parameter_offload_and_in_memory_runs(ranks, tmp_path):
    offload_helpers.checkpoints_move(
        ranks, tmp_path, _zero3(tmp_path / "a"), {"strategy": "zero"}, _zero3(tmp_path / "b", False)
    )


# -- a model built on the meta device ------------------------------------------------------------


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD: Adam would turn the rounding noise of a gradient that is zero in exact arithmetic
    # (the attention's key bias) into steps of its full size, in both runs differently.
    return torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9, weight_decay=0.01)


def _deferred(cfg: dict, steps: int, micro: int, device: str = "meta") -> dict:
    """A GPT built on the meta device, made by ZeRO-3; each rank trains on its slice of the
    same global batches."""
    import longboat
    from longboat.models import GPT, gpt_loss, synthetic_tokens

    with torch.device(device):
        net = GPT(**GPT_ARGS)
    engine = longboat.initialize(net, _optimizer(net), cfg)
    start = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    rank, g = engine.world.rank, torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = synthetic_tokens(micro * engine.world.world_size, GPT_ARGS["seq_len"], 128, g)
        mine = slice(rank * micro, (rank + 1) * micro)
        loss = gpt_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    end = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    out = {"start": start, "end": end, "losses": losses}
    engine.close()
    return out


def _plain_gpt(start: dict, steps: int, batch: int) -> tuple[list[float], dict]:
    """The plain loop from the same starting values: full batches, clipping at 1.0."""
    from longboat.models import GPT, gpt_loss, synthetic_tokens

    net = GPT(**GPT_ARGS)
    net.load_state_dict(start)
    opt = _optimizer(net)
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x, y = synthetic_tokens(batch, GPT_ARGS["seq_len"], 128, g)
        loss = gpt_loss(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net.state_dict()


@pytest.mark.parametrize(
    ("device", "offload"),
    [("meta", True), ("meta", False), ("cpu", False)],
    ids=["meta-on-disk", "meta-in-memory", "cpu-in-memory"],
)
def test_a_model_built_on_meta_is_made_unit_by_unit_and_trains_as_plain_pytorch(
    ranks, tmp_path, device, offload
):
    # Also the regression test of [Note: storage resize]: GPT's blocks are units of one size,
    # and when a freed unit's buffer was handed to the next unit's gather, the views autograd
    # had saved of it saw the other block's weights (the cpu-in-memory case failed at step 1).
    zero = _zero3(tmp_path) if offload else {"strategy": "zero", "zero": {"stage": 3}}
    zero["zero"]["unit_classes"] = ["_Block"]
    cfg = {**harness.QUIET, **zero, "batch": {"train_batch_size": 8}, "gradient_clipping": 1.0}
    got = ranks(2, _deferred, cfg, 4, 4, device)
    start = got[0]["start"]
    # made by each module's reset_parameters() and then GPT's own _init_weights (LayerNorm: ones
    # and zeros; Linear, Embedding: N(0, 0.02)), rank 0's values on every rank, the tied head
    # still the embedding
    assert reference.max_rel_diff(got[1]["start"], start) == 0.0
    assert torch.equal(start["ln_f.weight"], torch.ones(GPT_ARGS["d_model"]))
    assert all(v.abs().sum() > 0 for k, v in start.items() if k.endswith("weight"))
    assert torch.equal(start["lm_head.weight"], start["tok_emb.weight"])
    losses, end = _plain_gpt(start, 4, 8)
    for step, plain in enumerate(losses):
        mean = sum(r["losses"][step] for r in got) / 2
        assert abs(mean - plain) <= 1e-5 * abs(plain), (step, mean, plain)
    assert reference.max_rel_diff(got[0]["end"], end) < 1e-5


def _initialize(cfg: dict, build: str) -> None:
    import longboat
    from longboat.models import GPT

    with torch.device("meta"):
        net = GPT(**GPT_ARGS)
    if build == "frozen":
        net.ln_f.requires_grad_(False)  # a module of frozen parameters only
    longboat.initialize(net, torch.optim.AdamW(p for p in net.parameters() if p.requires_grad), cfg)


def test_what_cannot_be_made_or_offloaded_is_refused_by_name(ranks, tmp_path):
    base = {**harness.QUIET, "batch": {"train_batch_size": 8}}
    with pytest.raises(Exception, match="meta device, which strategy 'replicate' cannot make"):
        ranks(1, _initialize, {**base, "strategy": "replicate"}, "all")
    with pytest.raises(Exception, match=r"ln_f.weight, ln_f.bias stayed on the meta device"):
        ranks(1, _initialize, {**base, "strategy": "zero", "zero": {"stage": 3}}, "frozen")
    gpt = _zero3(tmp_path, units={"unit_classes": ["_Block"]})
    fp16 = {**base, **gpt, "precision": {"dtype": "fp16"}}
    with pytest.raises(Exception, match="precision fp16 checks every gradient"):
        ranks(1, _initialize, fp16, "all")
    hybrid = {**base, **gpt, "mesh": {"dp_replicate": 2}}
    with pytest.raises(Exception, match=r"mesh.dp_replicate = 2: parameter offload"):
        ranks(2, _initialize, hybrid, "all")
    with pytest.raises(ConfigError, match=re.escape("needs zero.stage = 3 (got 2)")):
        load_config({"strategy": "zero", "zero": {**_zero3(tmp_path)["zero"], "stage": 2}})


def test_deepspeeds_offload_param_is_translated(tmp_path):
    cfg = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {
                    "device": "nvme",
                    "nvme_path": str(tmp_path),
                    "buffer_count": 5,
                    "pin_memory": True,  # meaningful with an accelerator only
                },
            },
        }
    )
    off = cfg.zero.offload_param
    assert (off.device, off.path, off.buffer_count) == ("disk", str(tmp_path), 5)
    for bad, key in (({"max_in_cpu": 10**9}, "max_in_cpu"), ({"device": "tape"}, "device")):
        with pytest.raises(ConfigError, match=re.escape(f"offload_param.{key}")):
            load_config(
                {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": bad}}
            )
    with pytest.raises(ConfigError, match=re.escape("zero.stage = 3 (got 2)")):
        load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {
                    "stage": 2,
                    "offload_param": {"device": "nvme", "nvme_path": "/x"},
                },
            }
        )


class _Slow:
    """A collective's handle that never reports itself complete before it is waited for, as
    on a wire slower than the backward."""

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def wait(self) -> None:
        self.handle.wait()  # type: ignore[attr-defined]

    def is_completed(self) -> bool:
        return False


def _most_in_flight(cfg: dict) -> int:
    """The most gradient reductions in flight at once during two steps of a GPT whose four
    units' reductions never finish early."""
    import longboat
    from longboat.models import GPT, gpt_loss, synthetic_tokens

    net = GPT(**GPT_ARGS)
    engine = longboat.initialize(net, torch.optim.AdamW(net.parameters()), cfg)
    zero, most = engine.strategy, 0
    launch = zero.comm.reduce_scatter

    def counted(out: torch.Tensor, inp: torch.Tensor, **kw: object) -> _Slow:
        nonlocal most
        most = max(most, sum(u.reduced is not None for u in zero.units))
        return _Slow(launch(out, inp, **kw))

    zero.comm.reduce_scatter = counted
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = synthetic_tokens(4, GPT_ARGS["seq_len"], 128, g)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
    engine.close()
    return most


def test_reductions_in_flight_are_bounded_by_buffer_count(ranks, tmp_path):
    # Without the bound, a backward that outran the wire held every unit's full-size gradient
    # buffer and shard at its end (2.4 GiB peak RSS per rank in offload_headline, 0.9 with it).
    gpt = _zero3(tmp_path, buffer_count=1, units={"unit_classes": ["_Block"]})
    cfg = {**harness.QUIET, **gpt, "batch": {"train_batch_size": 8}}
    # each launch sees at most buffer_count earlier reductions, besides its own
    assert ranks(2, _most_in_flight, cfg) == [2, 2]
