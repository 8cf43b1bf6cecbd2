"""The compositions of strategies and parallelisms longboat refuses: inside ZeRO and the
parameter server, pipelines, joining ragged data, hierarchical reductions ([Note:
compositions] in ``config/compositions/__init__.py``)."""

from __future__ import annotations

from longboat.config.compositions.rule import (
    DISK_PARAMS,
    Rule,
    axes,
    join_with,
    zero,
)
from longboat.config.sections_parallel import SPLIT_BACKWARD_SCHEDULES

HIERARCHICAL_ZERO = (
    "comm.hierarchical = true with strategy 'zero': ZeRO reduces gradients by "
    "reduce-scatter, which has no hierarchical form here; set comm.hierarchical = "
    "false (comm.groups still spreads its reductions), or use strategy 'replicate'"
)

PARALLEL: tuple[Rule, ...] = (
    # -- within ZeRO and the parameter server ----------------------------------------------------
    Rule(
        "param-offload-needs-stage-3",
        "zero.offload_param",
        "zero.stage 1 or 2",
        "by nature",
        "config",
        lambda c, f: c.zero.offload_param.device != "none" and c.zero.stage != 3,
        lambda c, f: (
            f"zero.offload_param.device = {c.zero.offload_param.device!r} needs zero.stage = 3 "
            f"(got {c.zero.stage}): only stage 3 shards the parameters; set stage = 3 or "
            "remove the key"
        ),
        {"zero": {"stage": 2, "offload_param": {"device": "disk", "path": "/tmp/swap"}}},
    ),
    Rule(
        "server-averaging-needs-sync",
        "parameter_server.update_on_server = false",
        "parameter_server.mode 'async' or 'ssp'",
        "by nature",
        "config",
        lambda c, f: c.parameter_server.mode != "sync" and not c.parameter_server.update_on_server,
        lambda c, f: (
            f"parameter_server.update_on_server = false with mode = {c.parameter_server.mode!r}:"
            " without a step that waits for every worker there is no mean gradient to hand "
            "back, so the servers must run the optimizer (MXNet's rule); set it to true or use "
            "mode = 'sync'"
        ),
        {"parameter_server": {"mode": "async", "update_on_server": False}},
    ),
    Rule(
        "parameter-server-mesh",
        "strategy 'parameter_server'",
        "mesh.pp or mesh.tp > 1",
        "not built yet",
        "config",
        lambda c, f: c.strategy == "parameter_server" and (c.mesh.pp > 1 or c.mesh.tp > 1),
        lambda c, f: (
            f"strategy 'parameter_server' with mesh.pp = {c.mesh.pp}, mesh.tp = {c.mesh.tp}: "
            "its workers each run the whole model; set both to 1"
        ),
        {"strategy": "parameter_server", "mesh": {"pp": 2}},
    ),
    Rule(
        "parameter-server-fp16",
        "precision.dtype 'fp16'",
        "parameter_server.update_on_server = true",
        "by nature",
        "config",
        lambda c, f: (
            c.strategy == "parameter_server"
            and c.parameter_server.update_on_server
            and c.precision.dtype == "fp16"
        ),
        lambda c, f: (
            "precision.dtype = 'fp16' with parameter_server.update_on_server = true: a "
            "step the loss scaler skips would still reach the servers; use bf16, or "
            "update_on_server = false (sync mode)"
        ),
        {"strategy": "parameter_server", "precision": {"dtype": "fp16"}},
    ),
    Rule(
        "parameter-server-clipping",
        "gradient_clipping",
        "parameter_server.mode 'sync' with update_on_server = true",
        "by nature",
        "config",
        lambda c, f: (
            c.strategy == "parameter_server"
            and c.parameter_server.update_on_server
            and c.parameter_server.mode == "sync"
            and c.gradient_clipping > 0
        ),
        lambda c, f: (
            f"gradient_clipping = {c.gradient_clipping} with parameter_server.mode = "
            "'sync' and update_on_server = true: clipping must see the mean gradient, which "
            "only the servers hold; set update_on_server = false (the servers average and "
            "each worker clips and steps, equal to replicate). In async and ssp each push "
            "is clipped by its own norm."
        ),
        {"strategy": "parameter_server", "gradient_clipping": 1.0},
    ),
    Rule(
        "param-offload-fp16",
        "zero.offload_param to disk",
        "precision.dtype 'fp16'",
        "not built yet",
        "config",
        lambda c, f: (
            zero(c, f) and c.zero.offload_param.device == "disk" and c.precision.dtype == "fp16"
        ),
        lambda c, f: (
            "precision fp16 checks every gradient for overflow, which "
            "zero.offload_param.device = 'disk' keeps on disk: use bf16 or fp32, or remove "
            "the key"
        ),
        {**DISK_PARAMS, "precision": {"dtype": "fp16"}},
    ),
    Rule(
        "param-offload-mesh",
        "zero.offload_param to disk",
        "mesh.pp, mesh.tp or mesh.dp_replicate > 1",
        "not built yet",
        "config",
        lambda c, f: zero(c, f) and c.zero.offload_param.device == "disk" and bool(axes(c)),
        lambda c, f: (
            f"zero.offload_param.device = 'disk' with mesh.{axes(c)[0][0]} = {axes(c)[0][1]}: "
            f"parameter offload is implemented for plain ZeRO-3 (mesh.{axes(c)[0][0]} = 1) so "
            "far; remove the key or the axis"
        ),
        {**DISK_PARAMS, "mesh": {"tp": 2}},
    ),
    Rule(
        "virtual-stages-need-stages",
        "pipeline.virtual_stages > 1",
        "mesh.pp = 1",
        "by nature",
        "config",
        lambda c, f: c.mesh.pp == 1 and c.pipeline.virtual_stages != 1,
        lambda c, f: (
            f"key 'pipeline.virtual_stages' = {c.pipeline.virtual_stages} needs pipeline "
            "stages: set mesh.pp > 1, or leave it at 1"
        ),
        {"pipeline": {"virtual_stages": 2}},
    ),
    Rule(
        "zero-bubble-zero-3",
        "pipeline.schedule 'zb-h1' or 'interleaved-zb'",
        "zero.stage 3",
        "not built yet",
        "config",
        lambda c, f: (
            c.mesh.pp > 1
            and c.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES
            and zero(c, f)
            and c.zero.stage == 3
        ),
        lambda c, f: (
            f"pipeline.schedule = {c.pipeline.schedule!r} with strategy = 'zero' and "
            "zero.stage = 3: stage 3 gathers a layer's parameters for its backward and frees "
            "them at its end, and that schedule splits the backward into an input-gradient "
            "pass and a weight-gradient pass run later, which would need them gathered twice; "
            "use zero.stage = 1 or 2, or pipeline.schedule = '1f1b' or 'interleaved'"
        ),
        {
            "strategy": "zero",
            "zero": {"stage": 3},
            "mesh": {"pp": 2},
            "pipeline": {"schedule": "zb-h1"},
        },
    ),
    # -- joining ragged data ----------------------------------------------------------------------
    Rule(
        "join-parameter-server",
        "data.remainder 'join'",
        "strategy 'parameter_server'",
        "by nature",
        "config",
        lambda c, f: c.data.remainder == "join" and c.strategy == "parameter_server",
        join_with(
            lambda c: (
                "strategy 'parameter_server': async and ssp workers share no collective, so a "
                "worker whose data ends simply leaves (the servers drop it and the others go "
                "on), and in sync mode the servers average over every worker, not over those "
                "that pushed in a step"
            )
        ),
        {"strategy": "parameter_server", "data": {"remainder": "join"}},
    ),
    Rule(
        "join-pipeline",
        "data.remainder 'join'",
        "mesh.pp > 1",
        "not built yet",
        "config",
        lambda c, f: c.data.remainder == "join" and c.mesh.pp > 1,
        join_with(
            lambda c: (
                f"mesh.pp = {c.mesh.pp}: a pipeline runs whole steps through "
                "engine.train_step, its micro-batches passing between the stages, while join "
                "shadows the micro-batch loop (engine(x), backward, step)"
            )
        ),
        {"mesh": {"pp": 2}, "data": {"remainder": "join"}},
    ),
    Rule(
        "join-tensor-parallel",
        "data.remainder 'join'",
        "mesh.tp > 1",
        "not built yet",
        "config",
        lambda c, f: c.data.remainder == "join" and c.mesh.tp > 1,
        join_with(
            lambda c: (
                f"mesh.tp = {c.mesh.tp}: the tensor-parallel peers of a data-parallel rank "
                "share its batches and would run out together, but joining is not built and "
                "tested with tensor parallelism yet"
            )
        ),
        {"mesh": {"tp": 2}, "data": {"remainder": "join"}},
    ),
    Rule(
        "join-sync-batchnorm",
        "data.remainder 'join'",
        "sync_batchnorm",
        "by nature",
        "config",
        lambda c, f: c.data.remainder == "join" and c.sync_batchnorm,
        join_with(
            lambda c: (
                "sync_batchnorm: its statistics are all-reduced inside every batch-norm "
                "layer's forward and backward, which a rank without a batch does not run"
            )
        ),
        {"sync_batchnorm": True, "data": {"remainder": "join"}},
    ),
    # -- communication ----------------------------------------------------------------------------
    Rule(
        "hierarchical-zero",
        "comm.hierarchical",
        "strategy 'zero'",
        "not built yet",
        "config",
        lambda c, f: c.comm.hierarchical and zero(c, f),
        lambda c, f: HIERARCHICAL_ZERO,
        {"strategy": "zero", "comm": {"hierarchical": True}},
    ),
)
