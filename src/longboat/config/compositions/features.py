"""The compositions of features longboat refuses: optimizers that reduce themselves, gradient
compression, and what the model, the optimizer and the device decide ([Note: compositions] in
``config/compositions/__init__.py``)."""

from __future__ import annotations

from longboat.config.compositions.rule import (
    COMPRESSED,
    DISK_STATE,
    Facts,
    Rule,
    axes,
    compressing,
    compression_with,
    disk_key,
    low_params,
    named,
    offloads,
    on_disk,
    reducer,
    stage_named,
    strategy_of,
    wire_key,
    zero,
)
from longboat.config.sections import Config

#: ZeRO-3 with its parameters and optimizer in CPU memory ([Note: host parameter offload]).
_HOST_PARAMS = {
    "strategy": "zero",
    "zero": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
}


def _params_on_host(c: Config, f: Facts) -> bool:
    """``zero.offload_param.device = 'cpu'`` with the parameters on an accelerator."""
    return c.zero.offload_param.device == "cpu" and f.device not in (None, "cpu", "meta")


FEATURES: tuple[Rule, ...] = (
    # -- optimizers that reduce themselves (1-bit Adam, 1-bit LAMB) -----------------------------
    Rule(
        "self-reducing-sharded",
        "1-bit Adam or 1-bit LAMB",
        "strategy 'zero' or 'parameter_server'",
        "by nature",
        "build",
        lambda c, f: (
            reducer(c, f) is not None and strategy_of(c, f) in ("zero", "parameter_server")
        ),
        lambda c, f: (
            f"{named(c, f)} with strategy = {strategy_of(c, f)!r}: {reducer(c, f)} "
            "all-reduces each rank's whole momentum itself after its warm-up (DeepSpeed "
            "refuses it with ZeRO too); use strategy = 'replicate', or another optimizer"
        ),
        {"strategy": "zero", "optimizer": {"type": "OneBitAdam"}},
    ),
    Rule(
        "self-reducing-compression",
        "1-bit Adam or 1-bit LAMB",
        "compression",
        "by nature",
        "build",
        lambda c, f: reducer(c, f) is not None and compressing(c, f),
        lambda c, f: (
            f"{named(c, f)} with compression.method = {c.compression.method!r}: "
            f"{reducer(c, f)} compresses its own momentum, the gradient would be compressed "
            "twice; remove the [compression] section"
        ),
        {"optimizer": {"type": "OneBitAdam"}, **COMPRESSED},
    ),
    Rule(
        "self-reducing-mesh",
        "1-bit Adam or 1-bit LAMB",
        "mesh.pp or mesh.tp > 1",
        "not built yet",
        "build",
        lambda c, f: reducer(c, f) is not None and (c.mesh.pp > 1 or c.mesh.tp > 1),
        lambda c, f: (
            f"{named(c, f)} with mesh.pp = {c.mesh.pp}, mesh.tp = {c.mesh.tp}: it "
            "is built and tested on plain data parallelism only; use mesh.pp = mesh.tp = 1, or "
            "another optimizer"
        ),
        {"optimizer": {"type": "OneBitAdam"}, "mesh": {"tp": 2}},
    ),
    Rule(
        "self-reducing-join",
        "1-bit Adam or 1-bit LAMB",
        "data.remainder 'join'",
        "by nature",
        "build",
        lambda c, f: reducer(c, f) is not None and c.data.remainder == "join",
        lambda c, f: (
            f"{named(c, f)} with data.remainder = 'join': a rank without a batch "
            "would still send its momentum's residual; use 'pad' or 'drop', or another "
            "optimizer"
        ),
        {"optimizer": {"type": "OneBitAdam"}, "data": {"remainder": "join"}},
    ),
    # -- gradient compression -------------------------------------------------------------------
    Rule(
        "compression-parameter-server",
        "compression",
        "strategy 'parameter_server'",
        "by nature",
        "config",
        lambda c, f: compressing(c, f) and c.strategy == "parameter_server",
        compression_with(
            lambda c: "strategy 'parameter_server': its workers push to servers, with no all-reduce"
        ),
        {"strategy": "parameter_server", **COMPRESSED},
    ),
    Rule(
        "compression-communication-dtype",
        "compression",
        "precision.communication_data_type",
        "by nature",
        "config",
        lambda c, f: compressing(c, f) and c.precision.wire_dtype() not in (None, "fp32"),
        compression_with(
            lambda c: (
                f"precision.{wire_key(c)} = {c.precision.wire_dtype()!r}: "
                "a compressed method chooses what travels itself; remove one of the two"
            )
        ),
        {**COMPRESSED, "precision": {"communication_data_type": "bf16"}},
    ),
    Rule(
        "compression-fp16",
        "compression",
        "precision.dtype 'fp16'",
        "by nature",
        "config",
        lambda c, f: compressing(c, f) and c.precision.dtype == "fp16",
        compression_with(
            lambda c: (
                "precision.dtype = 'fp16': an overflowing step would leave inf in the "
                "error-feedback residual, which every later step would send; use 'bf16'"
            )
        ),
        {**COMPRESSED, "precision": {"dtype": "fp16"}},
    ),
    Rule(
        "compression-join",
        "compression",
        "data.remainder 'join'",
        "by nature",
        "config",
        lambda c, f: compressing(c, f) and c.data.remainder == "join",
        compression_with(
            lambda c: (
                "data.remainder = 'join': a rank without a batch would still send its "
                "error-feedback residual, which is not a zero contribution; use 'pad' or 'drop'"
            )
        ),
        {**COMPRESSED, "data": {"remainder": "join"}},
    ),
    Rule(
        "compression-mesh",
        "compression",
        "mesh.pp or mesh.tp > 1",
        "not built yet",
        "config",
        lambda c, f: compressing(c, f) and (c.mesh.pp > 1 or c.mesh.tp > 1),
        compression_with(
            lambda c: (
                f"mesh.pp = {c.mesh.pp}, mesh.tp = {c.mesh.tp}: compression is built and "
                "tested on plain data parallelism only so far; use mesh.pp = mesh.tp = 1"
            )
        ),
        {**COMPRESSED, "mesh": {"tp": 2}},
    ),
    Rule(
        "compression-groups",
        "compression",
        "comm.groups > 1 or comm.hierarchical",
        "not built yet",
        "config",
        lambda c, f: compressing(c, f) and (c.comm.groups > 1 or c.comm.hierarchical),
        compression_with(
            lambda c: (
                f"comm.groups = {c.comm.groups}, comm.hierarchical = "
                f"{str(c.comm.hierarchical).lower()}: compressed reductions travel on the "
                "data-parallel group itself; use comm.groups = 1 and comm.hierarchical = false"
            )
        ),
        {**COMPRESSED, "comm": {"groups": 2}},
    ),
    # -- parameters in a lower precision (FSDP2's param_dtype) ------------------------------------
    Rule(
        "reduce-dtype-twice",
        "precision.reduce_dtype",
        "precision.communication_data_type",
        "by nature",
        "config",
        lambda c, f: (
            None not in (c.precision.reduce_dtype, c.precision.communication_data_type)
            and c.precision.reduce_dtype != c.precision.communication_data_type
        ),
        lambda c, f: (
            f"precision.reduce_dtype = {c.precision.reduce_dtype!r} with "
            f"precision.communication_data_type = {c.precision.communication_data_type!r}: "
            "the two name the same dtype (FSDP2's and DeepSpeed's name); keep one"
        ),
        {"precision": {"reduce_dtype": "fp32", "communication_data_type": "bf16"}},
    ),
    Rule(
        "param-dtype-zero",
        "precision.param_dtype 'bf16'",
        "any strategy but ZeRO",
        "not built yet",
        "config",
        lambda c, f: low_params(c) and not zero(c, f),
        lambda c, f: (
            f"precision.param_dtype = 'bf16' with {stage_named(c, f)}: parameters are kept "
            "in a lower precision beside fp32 masters by ZeRO only so far (elsewhere each "
            "rank keeps whole fp32 parameters, and autocast computes from them in "
            "precision.dtype); use strategy = 'zero' (any zero.stage), or remove the key"
        ),
        {"strategy": "replicate", "precision": {"dtype": "bf16", "param_dtype": "bf16"}},
    ),
    Rule(
        "param-dtype-autocast",
        "precision.param_dtype 'bf16'",
        "precision.dtype other than 'bf16'",
        "not built yet",
        "config",
        lambda c, f: low_params(c) and c.precision.dtype != "bf16",
        lambda c, f: (
            f"precision.param_dtype = 'bf16' with precision.dtype = {c.precision.dtype!r}: the "
            "forward's inputs would meet bf16 weights outside bf16 autocast; set "
            "precision.dtype = 'bf16'"
        ),
        {"strategy": "zero", "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"}},
    ),
    Rule(
        "param-dtype-offload",
        "precision.param_dtype 'bf16'",
        "zero offload",
        "not built yet",
        "config",
        lambda c, f: low_params(c) and offloads(c),
        lambda c, f: (
            "precision.param_dtype = 'bf16' with zero offload: the offloaded homes keep and "
            "bring shards in their own dtype so far; remove one of the two"
        ),
        {
            "strategy": "zero",
            "zero": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "precision": {"dtype": "bf16", "param_dtype": "bf16"},
        },
    ),
    Rule(
        "param-dtype-mesh",
        "precision.param_dtype 'bf16'",
        "mesh.pp, mesh.tp or mesh.dp_replicate > 1",
        "not built yet",
        "config",
        lambda c, f: low_params(c) and bool(axes(c)),
        lambda c, f: (
            f"precision.param_dtype = 'bf16' with mesh.{axes(c)[0][0]} = {axes(c)[0][1]}: "
            "parameters in a lower precision are built and tested on plain ZeRO only so "
            f"far; use mesh.{axes(c)[0][0]} = 1, or remove the key"
        ),
        {
            "strategy": "zero",
            "zero": {"stage": 3},
            "mesh": {"tp": 2},
            "precision": {"dtype": "bf16", "param_dtype": "bf16"},
        },
    ),
    Rule(
        "param-dtype-compression",
        "precision.param_dtype 'bf16'",
        "compression",
        "not built yet",
        "config",
        lambda c, f: low_params(c) and compressing(c, f),
        lambda c, f: (
            f"precision.param_dtype = 'bf16' with compression.method = "
            f"{c.compression.method!r}: the compressors keep fp32 residuals of fp32 gradients "
            "so far; remove one of the two"
        ),
        {
            "strategy": "zero",
            "zero": {"stage": 3},
            **COMPRESSED,
            "precision": {"dtype": "bf16", "param_dtype": "bf16"},
        },
    ),
    # -- what the model, the optimizer and the device decide -------------------------------------
    Rule(
        "meta-device",
        "a model on the meta device",
        "any strategy but ZeRO-3",
        "by nature",
        "build",
        lambda c, f: bool(f.meta) and f.deferred_init is False,
        lambda c, f: (
            f"the model's parameters are on the meta device, which strategy "
            f"{strategy_of(c, f)!r} cannot make: build the model on a device, or use "
            "strategy 'zero' with zero.stage = 3 (it makes them unit by unit)"
        ),
        {"strategy": "replicate"},
        Facts(strategy="replicate", meta=True, deferred_init=False),
    ),
    Rule(
        "zero-elementwise",
        "an optimizer that is not element-wise",
        "strategy 'zero'",
        "by nature",
        "build",
        lambda c, f: zero(c, f) and f.elementwise is False,
        lambda c, f: (
            "strategy 'zero' steps the optimizer on pieces of flat shards, which is exact "
            f"only for element-wise optimizers: {f.elementwise_ones}; {f.optimizer} is not one "
            f"of them ({f.not_elementwise_why}). Use strategy 'replicate', or one of those "
            "optimizers"
        ),
        {"strategy": "zero"},
        Facts(
            optimizer="Lamb",
            elementwise=False,
            not_elementwise_why="its trust ratio is a norm over the whole tensor",
            elementwise_ones="SGD, Adam, AdamW, ... (exact classes)",
        ),
    ),
    Rule(
        "server-elementwise",
        "an optimizer that is not element-wise",
        "parameter_server.update_on_server = true",
        "by nature",
        "build",
        lambda c, f: (
            strategy_of(c, f) == "parameter_server"
            and c.parameter_server.update_on_server
            and f.elementwise is False
        ),
        lambda c, f: (
            f"parameter_server.update_on_server = true with {f.optimizer}: the servers step "
            "ranges of the parameters, which is exact only for per-element optimizers "
            f"({f.elementwise_ones}); set update_on_server = false (sync mode)"
        ),
        {"strategy": "parameter_server"},
        Facts(optimizer="Lamb", elementwise=False, elementwise_ones="SGD, Adam, AdamW, ..."),
    ),
    Rule(
        "disk-offload-step-hooks",
        "zero offload to disk",
        "optimizer step hooks",
        "by nature",
        "build",
        lambda c, f: zero(c, f) and on_disk(c) and bool(f.step_hooks),
        lambda c, f: (
            "zero offload to disk steps the optimizer unit by unit, which step hooks would "
            "see several times per step; remove the hooks or the offload keys"
        ),
        DISK_STATE,
        Facts(step_hooks=True),
    ),
    Rule(
        "disk-offload-accelerator",
        "zero offload to disk",
        "parameters on an accelerator",
        "not built yet",
        "build",
        lambda c, f: zero(c, f) and on_disk(c) and f.device not in (None, "cpu", "meta"),
        lambda c, f: (
            f"zero.{disk_key(c)}.device = 'disk' with parameters on {f.device}: offload to "
            "disk is implemented for CPU training only so far; remove the key"
        ),
        DISK_STATE,
        Facts(device="cuda"),
    ),
    Rule(
        "host-offload-step-hooks",
        "zero offload to CPU memory beside an accelerator",
        "optimizer step hooks",
        "by nature",
        "build",
        lambda c, f: (
            zero(c, f)
            and c.zero.offload_optimizer.device == "cpu"
            and f.device not in (None, "cpu", "meta")
            and bool(f.step_hooks)
        ),
        lambda c, f: (
            "zero.offload_optimizer.device = 'cpu' beside an accelerator steps the optimizer "
            "unit by unit on the host, which step hooks would see several times per step; "
            "remove the hooks or the offload key"
        ),
        {"strategy": "zero", "zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        Facts(device="cuda", step_hooks=True),
    ),
    Rule(
        "cpu-param-offload-accelerator",
        "zero.offload_param to CPU memory beside an accelerator",
        "zero.offload_optimizer.device other than 'cpu'",
        "by nature",
        "build",
        lambda c, f: (
            zero(c, f) and _params_on_host(c, f) and c.zero.offload_optimizer.device != "cpu"
        ),
        lambda c, f: (
            f"zero.offload_param.device = 'cpu' with parameters on {f.device} and "
            f"zero.offload_optimizer.device = {c.zero.offload_optimizer.device!r}: the "
            "parameter shards live in CPU memory as the optimizer's masters, so the optimizer "
            "steps there too; set zero.offload_optimizer.device = 'cpu', or remove the key"
        ),
        {"strategy": "zero", "zero": {"stage": 3, "offload_param": {"device": "cpu"}}},
        Facts(device="cuda"),
    ),
    Rule(
        "cpu-param-offload-fp16",
        "zero.offload_param to CPU memory beside an accelerator",
        "precision.dtype 'fp16'",
        "not built yet",
        "build",
        lambda c, f: zero(c, f) and _params_on_host(c, f) and c.precision.dtype == "fp16",
        lambda c, f: (
            "precision fp16 checks every gradient for overflow, which "
            "zero.offload_param.device = 'cpu' keeps in CPU memory beside the accelerator: use "
            "bf16 or fp32, or remove the key"
        ),
        {**_HOST_PARAMS, "precision": {"dtype": "fp16"}},
        Facts(device="cuda"),
    ),
    Rule(
        "cpu-param-offload-mesh",
        "zero.offload_param to CPU memory beside an accelerator",
        "mesh.pp, mesh.tp or mesh.dp_replicate > 1",
        "not built yet",
        "build",
        lambda c, f: zero(c, f) and _params_on_host(c, f) and bool(axes(c)),
        lambda c, f: (
            f"zero.offload_param.device = 'cpu' beside an accelerator with "
            f"mesh.{axes(c)[0][0]} = {axes(c)[0][1]}: parameter offload is implemented for "
            f"plain ZeRO-3 (mesh.{axes(c)[0][0]} = 1) so far; remove the key or the axis"
        ),
        {**_HOST_PARAMS, "mesh": {"dp_replicate": 2}},
        Facts(device="cuda"),
    ),
)
