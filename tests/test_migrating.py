"""``docs/migrating.md``: every row's config loads and resolves, at 4 ranks, to the strategy
expected for the framework it names; a row added without an expectation here fails."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from longboat.config import load_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"

# row's first column -> (strategy, zero stage or None, mesh dp_replicate, parameter-server mode)
EXPECTED = {
    "torch `DataParallel`": ("replicate", None, 1, None),
    "torch `DistributedDataParallel`": ("replicate", None, 1, None),
    "torch FSDP `NO_SHARD`": ("replicate", None, 1, None),
    "torch DDP under `torch.distributed.algorithms.Join`": ("replicate", None, 1, None),
    "torch FSDP `SHARD_GRAD_OP` / FSDP2 `reshard_after_forward=False`": ("zero", 2, 1, None),
    "torch FSDP `FULL_SHARD` / FSDP2 `fully_shard`": ("zero", 3, 1, None),
    "torch FSDP `HYBRID_SHARD` / FSDP2 on a 2-D mesh": ("zero", 3, 2, None),
    "TensorFlow `OneDeviceStrategy`": ("single", None, 1, None),
    "TensorFlow `MirroredStrategy`": ("replicate", None, 1, None),
    "TensorFlow `MultiWorkerMirroredStrategy`": ("replicate", None, 1, None),
    "TensorFlow `CentralStorageStrategy`": ("parameter_server", None, 1, "sync"),
    "TensorFlow `ParameterServerStrategy`": ("parameter_server", None, 1, "async"),
    "Paddle Fleet collective mode": ("replicate", None, 1, None),
    "Paddle Fleet collective with `sharding` (stage 1, 2, 3)": ("zero", 2, 1, None),
    "Paddle Fleet `nccl_comm_num = 2`": ("replicate", None, 1, None),
    "Paddle Fleet `use_hierarchical_allreduce = True`": ("replicate", None, 1, None),
    "Paddle Fleet parameter-server mode, `a_sync = False`": ("parameter_server", None, 1, "sync"),
    "Paddle Fleet parameter-server mode, `a_sync = True`": ("parameter_server", None, 1, "async"),
    "MXNet KVStore `local` / `device`": ("replicate", None, 1, None),
    "MXNet KVStore `dist_sync` / `dist_device_sync`": ("parameter_server", None, 1, "sync"),
    "MXNet KVStore `dist_async`": ("parameter_server", None, 1, "async"),
    "Accelerate `MULTI_GPU` / `MULTI_CPU`": ("replicate", None, 1, None),
    "Accelerate `DeepSpeedPlugin(zero_stage=N)`": ("zero", 2, 1, None),
    'Accelerate `FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")`': (
        "zero",
        3,
        1,
        None,
    ),
    'Lightning Fabric `strategy="ddp"`': ("replicate", None, 1, None),
    'Lightning Fabric `strategy="fsdp"`': ("zero", 3, 1, None),
    'Lightning Fabric `strategy="deepspeed_stage_2"`': ("zero", 2, 1, None),
    'Lightning Fabric `strategy="deepspeed_stage_3_offload"`': ("zero", 3, 1, None),
    'Lightning Fabric `strategy="single_device"`': ("single", None, 1, None),
    "Horovod `hvd.join()`": ("replicate", None, 1, None),
    'DeepSpeed `"optimizer": {"type": "Lamb"}`': ("replicate", None, 1, None),
    'DeepSpeed `"optimizer": {"type": "OneBitAdam"}`': ("replicate", None, 1, None),
    'DeepSpeed `"optimizer": {"type": "OneBitLamb"}`': ("replicate", None, 1, None),
    'DeepSpeed `PipelineModule(layers, num_stages=2, partition_method="uniform")`': (
        "replicate",
        None,
        1,
        None,
    ),
    "DeepSpeed `activation_checkpointing.cpu_checkpointing`": ("replicate", None, 1, None),
}
# row -> further keys the row's config must resolve to
FIELDS = {
    "Horovod `hvd.join()`": {"data.remainder": "join"},
    "Paddle Fleet `nccl_comm_num = 2`": {"comm.groups": 2},
    "Paddle Fleet `use_hierarchical_allreduce = True`": {"comm.hierarchical": True},
    'DeepSpeed `"optimizer": {"type": "Lamb"}`': {"optimizer.type": "Lamb"},
    'DeepSpeed `"optimizer": {"type": "OneBitAdam"}`': {"optimizer.type": "OneBitAdam"},
    'DeepSpeed `"optimizer": {"type": "OneBitLamb"}`': {"optimizer.type": "OneBitLamb"},
    "DeepSpeed `activation_checkpointing.cpu_checkpointing`": {
        "activation_checkpointing.cpu_checkpointing": True
    },
    'DeepSpeed `PipelineModule(layers, num_stages=2, partition_method="uniform")`': {
        "mesh.pp": 2,
        "pipeline.partition": "uniform",
    },
}


def _rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[2].startswith("`") and cells[0] not in ("from", "---"):
            rows[cells[0]] = cells[2].strip("`")
    return rows


def test_every_row_has_an_expectation():
    assert set(_rows()) == set(EXPECTED)


@pytest.mark.parametrize("row", sorted(EXPECTED))
def test_each_row_resolves_as_its_framework_means(row):
    snippet = _rows()[row]
    cfg = load_config(
        {"batch": {"micro_batch_size": 4}, **tomllib.loads(snippet.replace("; ", "\n"))}
    )
    strategy, stage, replicas, mode = EXPECTED[row]
    assert cfg.resolved_strategy(4) == strategy
    if stage is not None:
        assert cfg.zero.stage == stage
    assert (cfg.mesh.dp_replicate or 1) == replicas
    if mode is not None:
        assert cfg.parameter_server.mode == mode
    for key, want in FIELDS.get(row, {}).items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == want, (row, key)


def test_each_deepspeed_script_row_names_tests_that_exist():
    """The "DeepSpeed scripts" table: every row cites test functions, and each is defined in
    the file named before it (a row may cite several files, separated by "; ")."""
    section = DOC.read_text().split("## DeepSpeed scripts", 1)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and ".py: `test_" in ln]
    assert len(rows) >= 7
    for row in rows:
        cited = row.rstrip(" |").rsplit(" | ", 1)[1]
        for part in re.split(r"; (?=test_\w+\.py)", cited):  # "FILE: `test`, ...; FILE: ..."
            file, _, names = part.partition(": ")
            source = (DOC.parents[1] / "tests" / file.split(" ")[0]).read_text()
            for name in re.findall(r"`(test_\w+)`", names):
                assert f"def {name}(" in source, (file, name)
