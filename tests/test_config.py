"""Config: errors name key and value; the batch triple; the DeepSpeed dialect; explain."""

import json
from typing import Any

import pytest

from longboat.config import (
    BatchConfig,
    ConfigError,
    explain,
    load,
    load_config,
    resolve_batch,
)


@pytest.mark.parametrize(
    ("t", "m", "a", "n", "want"),
    [
        (64, 8, None, 4, (64, 8, 2)),
        (64, None, 2, 4, (64, 8, 2)),
        (None, 8, 2, 4, (64, 8, 2)),
        (None, 8, None, 2, (16, 8, 1)),
        (32, None, None, 4, (32, 8, 1)),
        (64, 8, 2, 4, (64, 8, 2)),
    ],
)
def test_batch_triple_any_two_give_the_third(t, m, a, n, want):
    r = resolve_batch(
        BatchConfig(train_batch_size=t, micro_batch_size=m, gradient_accumulation_steps=a), n
    )
    assert (r.train_batch_size, r.micro_batch_size, r.gradient_accumulation_steps) == want
    assert r.train_batch_size == r.micro_batch_size * r.gradient_accumulation_steps * n


@pytest.mark.parametrize(
    ("kw", "n", "words"),
    [
        (
            {"train_batch_size": 64, "micro_batch_size": 8, "gradient_accumulation_steps": 3},
            4,
            ["train_batch_size=64", "micro_batch_size=8", "gradient_accumulation_steps=3", "96"],
        ),
        (
            {"train_batch_size": 10, "micro_batch_size": 3},
            2,
            ["train_batch_size=10", "multiple of 6"],
        ),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, 1, ["train_batch_size=10"]),
        ({}, 2, ["batch.micro_batch_size"]),
    ],
)
def test_batch_triple_errors_name_values(kw, n, words):
    with pytest.raises(ConfigError) as e:
        resolve_batch(BatchConfig(**kw), n)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"stratgy": "replicate"}, ["stratgy", "'replicate'", "did you mean 'strategy'"]),
        ({"batch": {"micro_bach_size": 4}}, ["batch.micro_bach_size", "batch.micro_batch_size"]),
        ({"batch": {"micro_batch_size": 0}}, ["batch.micro_batch_size", "0"]),
        ({"batch": {"micro_batch_size": "many"}}, ["batch.micro_batch_size", "'many'"]),
        ({"strategy": "ddp"}, ["strategy", "'ddp'", "replicate"]),
        ({"gradient_clipping": -1}, ["gradient_clipping", "-1"]),
        ({"data": {"remainder": "keep"}}, ["data.remainder", "'keep'", "drop"]),
        ({"replicate": {"bucket_mb": 0}}, ["replicate.bucket_mb", "0"]),
    ],
)
def test_errors_name_key_and_value(data, words):
    with pytest.raises(ConfigError) as e:
        load_config(data)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_files_toml_json_yaml(tmp_path):
    (tmp_path / "a.toml").write_text(
        'strategy = "replicate"\ngradient_clipping = 1.0\n[batch]\nmicro_batch_size = 4\n'
    )
    (tmp_path / "a.json").write_text(
        json.dumps(
            {"strategy": "replicate", "gradient_clipping": 1.0, "batch": {"micro_batch_size": 4}}
        )
    )
    (tmp_path / "a.yaml").write_text(
        "strategy: replicate\ngradient_clipping: 1.0\nbatch:\n  micro_batch_size: 4\n"
    )
    cfgs = [load_config(tmp_path / f"a.{ext}") for ext in ("toml", "json", "yaml")]
    assert cfgs[0] == cfgs[1] == cfgs[2]
    assert cfgs[0].batch.micro_batch_size == 4 and cfgs[0].strategy == "replicate"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("strategy = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(ConfigError, match="extension"):
        load_config(tmp_path / "c.ini")
    (tmp_path / "typo.toml").write_text("[batch]\nmicro_batch = 4\n")
    with pytest.raises(ConfigError, match=r"typo.toml(.|\n)*batch.micro_batch_size"):
        load_config(tmp_path / "typo.toml")


def test_deepspeed_dialect_translates():
    ds = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": 0},
    }
    cfg = load_config(ds)
    assert cfg.batch.train_batch_size == 64 and cfg.batch.micro_batch_size == 8
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"  # DeepSpeed Adam = AdamW
    assert cfg.optimizer.params == {"lr": 3e-4, "weight_decay": 0.01}
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert cfg.strategy == "replicate"
    assert resolve_batch(cfg.batch, 4).gradient_accumulation_steps == 2
    plain_adam = load_config(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1.0, "adam_w_mode": False}},
        }
    )
    assert plain_adam.optimizer is not None and plain_adam.optimizer.type == "Adam"
    bf16 = load_config({"train_batch_size": 8, "bf16": {"enabled": True}})
    assert bf16.precision.dtype == "bf16"
    fp16_off = load_config({"train_batch_size": 8, "fp16": {"enabled": False}})
    assert fp16_off.precision.dtype == "fp32"


@pytest.mark.parametrize(
    ("ds", "words"),
    [
        ({"train_batch_size": 8, "comet": {"enabled": True}}, ["comet"]),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage": 4}},
            ["zero_optimization.stage", "4"],
        ),
        (  # a misspelt key, with the key meant
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 10},
            },
            ["zero_optimization.stage3_param_persitence_threshold", "stage3_param_persistence"],
        ),
        ({"train_batch_size": 8, "gradient_clippping": 1.0}, ["did you mean 'gradient_clipping'"]),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage": 2, "mics_shard_size": 4}},
            ["zero_optimization.mics_shard_size", "mesh.dp_shard"],
        ),
        ({"fp16": {"enabled": True}}, ["'train_batch_size'", "'train_micro_batch_size_per_gpu'"]),
        (
            {"train_batch_size": 8, "zero_optimization": {"zero_hpz_partition_size": 8}},
            ["zero_optimization.zero_hpz_partition_size", "mesh.dp_shard"],
        ),
        ({"train_batch_size": 8, "elasticity": {"enabled": True}}, ["elasticity", "max-restarts"]),
        ({"train_batch_size": 8, "data_types": {"grad_accum_dtype": "bf16"}}, ["grad_accum_dtype"]),
        (
            {"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
            ["'bf16' and 'bfloat16'"],
        ),
        (
            {"train_batch_size": 8, "fp16": {"enabled": True, "consecutive_hysteresis": True}},
            ["fp16.consecutive_hysteresis"],
        ),
        ({"train_batch_size": 8, "bf16": {"enabled": True, "loss_scale": 0}}, ["bf16.loss_scale"]),
        ({"train_batch_size": 8, "fp16": {"enabled": "auto"}}, ["fp16.enabled", "auto", "fp16="]),
        ({"train_batch_size": 8, "steps_per_print": "auto"}, ["steps_per_print", "does not"]),
        (
            {"train_batch_size": 8, "communication_data_type": "int8"},
            ["communication_data_type", "int8"],
        ),
        (
            {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
            ["fp16.enabled", "bf16.enabled"],
        ),
        ({"train_batch_size": 8, "optimizer": {"params": {}}}, ["optimizer", "type"]),
        (
            {"train_batch_size": 8, "optimizer": {"type": "ZeroOneAdam", "params": {}}},
            ["'optimizer.type' = 'ZeroOneAdam'", "torch.optim"],
        ),
        (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "OneBitAdam", "params": {}},
                "zero_optimization": {"stage": 2},
            },
            ["optimizer.type = 'OneBitAdam'", "strategy = 'zero'"],
        ),
        (
            {"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {}}},
            ["'scheduler.type' = 'OneCycle'", "WarmupLR"],
        ),
        ({"train_batch_size": 8, "pipeline": {"stages": 0}}, ["pipeline.stages", "0"]),
        ({"train_batch_size": 8, "pipeline": {"seed_layers": True}}, ["pipeline.seed_layers"]),
        (
            {"train_batch_size": 8, "pipeline": {"activation_checkpoint_interval": 1}},
            ["pipeline.activation_checkpoint_interval", "[activation_checkpointing] classes"],
        ),
        ({"train_batch_size": 8, "pipeline": {"micro_batches": 4}}, ["pipeline.micro_batches"]),
        (
            {"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": "yes"}},
            ["activation_checkpointing.cpu_checkpointing", "'yes'"],
        ),
    ],
)
def test_deepspeed_unsupported_keys_are_named(ds, words):
    with pytest.raises(ConfigError) as e:
        load_config(ds)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_deepspeed_precision_keys_translate():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "communication_data_type": "bf16",
            "fp16": {
                "enabled": True,
                "auto_cast": False,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 100,
                "hysteresis": 3,
                "min_loss_scale": 0.5,
            },
        }
    )
    p = cfg.precision
    assert (
        p.dtype,
        p.loss_scale,
        p.initial_scale_power,
        p.loss_scale_window,
        p.hysteresis,
        p.min_loss_scale,
        p.communication_data_type,
    ) == ("fp16", 0, 12, 100, 3, 0.5, "bf16")
    static = load_config({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128}})
    assert static.precision.loss_scale == 128
    # A disabled block is ignored whole, as DeepSpeed does.
    off = load_config({"train_batch_size": 8, "fp16": {"enabled": False, "hysteresis": 9}})
    assert off.precision.dtype == "fp32" and off.precision.hysteresis == 2
    sources = load({"train_batch_size": 8, "fp16": {"enabled": True, "hysteresis": 4}}).sources
    assert "fp16.hysteresis" in sources["precision.hysteresis"]


def test_deepspeed_zero_stages():
    for stage in (1, 2, 3):
        cfg = load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**20},
            }
        )
        assert cfg.strategy == "zero" and cfg.zero.stage == stage
        assert cfg.zero.bucket_mb == 4.0  # 2**20 fp32 elements


def test_deepspeed_pipeline_and_activation_checkpointing_keys():
    loaded = load(
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 4,
            "pipeline": {
                "stages": 2,
                "partition": "type:_Block",
                "pipe_partitioned": True,
                "grad_partitioned": False,
                "activation_checkpoint_interval": 0,
            },
            "activation_checkpointing": {
                "partition_activations": False,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 4,
                "synchronize_checkpoint_boundary": True,
                "profile": False,
            },
        }
    )
    cfg = loaded.config
    assert cfg.mesh.pp == 2 and cfg.pipeline.partition == "type:_Block"
    assert "pipeline.stages" in loaded.sources["mesh.pp"]
    assert cfg.pipeline.schedule == "1f1b"  # DeepSpeed's TrainSchedule is 1F1B
    assert cfg.activation_checkpointing.classes == []  # DeepSpeed's model code chooses those
    # DeepSpeed's defaults change nothing
    auto = load_config({"train_batch_size": 8, "pipeline": {"stages": "auto", "partition": "best"}})
    assert auto.mesh.pp == 1 and auto.pipeline.partition is None


def test_deepspeed_json_file(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    )
    loaded = load(p)
    assert loaded.config.batch.micro_batch_size == 4
    assert "train_micro_batch_size_per_gpu" in loaded.sources["batch.micro_batch_size"]


def test_explain_shows_values_and_sources(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[batch]\ntrain_batch_size = 64\nmicro_batch_size = 8\n")
    text = explain(p, world_size=4)
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:]}
    assert (
        "derived: train 64 / (micro 8 x data-parallel 4)"
        in lines["batch.gradient_accumulation_steps"]
    )
    assert " 2 " in lines["batch.gradient_accumulation_steps"]
    assert "t.toml" in lines["batch.train_batch_size"]
    assert "auto -> replicate" in lines["strategy"]
    assert "default" in lines["replicate.bucket_mb"]


def test_deepspeed_keys_without_effect_are_accepted_with_one_line_each(caplog):
    import logging

    ds = {
        "train_batch_size": 8,
        "steps_per_print": 50,
        "prescale_gradients": False,
        "zero_allow_untested_optimizer": True,
        "wandb": {"enabled": False},  # off: trains the same
        "cuda_visible_devices": "0,1",  # not DeepSpeed's: ignored as DeepSpeed ignores it
        "activation_checkpointing": {"partition_activations": True},  # no tp ranks to split over
        "bfloat16": {"enabled": True},  # DeepSpeed's other name for bf16
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_prefetch_bucket_size": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            "zero_hpz_partition_size": 1,  # DeepSpeed's default: off
            "cpu_offload": True,  # DeepSpeed's old name for offload_optimizer device cpu
        },
    }
    with caplog.at_level(logging.INFO, logger="longboat"):
        cfg = load_config(ds)
    assert cfg.monitor.every == 50 and cfg.precision.dtype == "bf16"
    assert (cfg.zero.stage, cfg.zero.prefetch) == (3, False)  # prefetch bucket 0: none
    assert cfg.zero.offload_optimizer.device == "cpu"
    assert load_config({"train_batch_size": 8, "zero_optimization": True}).zero.stage == 1
    said = [r.getMessage() for r in caplog.records if "has no effect here" in r.getMessage()]
    for key in (
        "'prescale_gradients'",
        "'zero_allow_untested_optimizer'",
        "'zero_optimization.overlap_comm'",
        "'zero_optimization.contiguous_gradients'",
        "'zero_optimization.stage3_param_persistence_threshold'",
        "'zero_optimization.stage3_gather_16bit_weights_on_model_save'",
    ):
        assert sum(key in m for m in said) == 1, (key, said)
    assert not any("steps_per_print" in m or "wandb" in m for m in said)  # translated / off
    assert any("partition_activations" in m for m in said)
    ignored = [r.getMessage() for r in caplog.records if "ignored, as DeepSpeed" in r.getMessage()]
    assert len(ignored) == 1 and "'cuda_visible_devices'" in ignored[0]


# Hugging Face's DeepSpeed integration docs' style: every value the Trainer knows is "auto".
HF_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
TRAINER = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "max_grad_norm": 1.0,
    "learning_rate": 3e-4,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.1,
    "warmup_steps": 100,
    "fp16": False,
    "bf16": True,
    "hidden_size": 512,
}


def test_hugging_faces_auto_values_resolve_from_the_trainers_arguments():
    cfg = load_config(HF_AUTO, trainer_args=TRAINER)
    assert (cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps) == (4, 2)
    assert cfg.batch.train_batch_size is None  # derived from the world size, as the Trainer does
    assert cfg.gradient_clipping == 1.0 and cfg.precision.dtype == "bf16"
    assert cfg.optimizer is not None and cfg.optimizer.params == {
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert cfg.scheduler is not None and cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 100,
    }
    assert cfg.zero.bucket_mb == 512 * 512 * 4 / 2**20  # hidden_size squared elements


def test_an_auto_without_its_trainer_argument_names_both():
    with pytest.raises(ConfigError) as e:
        load_config(HF_AUTO, trainer_args={k: v for k, v in TRAINER.items() if k != "adam_beta2"})
    msg = str(e.value)
    assert "'optimizer.params.betas' = 'auto'" in msg and "adam_beta2=" in msg, msg
    with pytest.raises(ConfigError, match="'train_micro_batch_size_per_gpu' = 'auto'"):
        load_config({"train_micro_batch_size_per_gpu": "auto"})


def test_config_explain_takes_trainer_arguments(tmp_path):
    from typer.testing import CliRunner

    from longboat.cli import app

    p = tmp_path / "ds.json"
    p.write_text(json.dumps(HF_AUTO))
    args = [f"--trainer-arg={k}={json.dumps(v)}" for k, v in TRAINER.items()]
    res = CliRunner().invoke(app, ["config", "explain", str(p), "--world-size", "2", *args])
    assert res.exit_code == 0, res.output
    assert "train_batch_size" in res.output and "16" in res.output  # 4 x 2 x 2 ranks
    res = CliRunner().invoke(app, ["config", "explain", str(p), "--world-size", "2"])
    assert res.exit_code == 2 and "'auto'" in res.output, res.output


@pytest.mark.parametrize("zero", [None, {"stage": 0}, False])
def test_explain_of_a_deepspeed_config_without_zero_shows_stage_0(tmp_path, zero):
    """DeepSpeed runs without ZeRO when zero_optimization is absent (get_zero_config reads {},
    stage 0), is stage 0 or is false: explain says so instead of the unused zero.stage = 1."""
    from typer.testing import CliRunner

    from longboat.cli import app

    ds: dict[str, Any] = {"train_batch_size": 8}
    if zero is not None:
        ds["zero_optimization"] = zero
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    res = CliRunner().invoke(app, ["config", "explain", str(p), "--world-size", "2"])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln for ln in res.output.splitlines()[1:] if ln.strip()}
    assert lines["zero.stage"].split()[1] == "0"
    assert "DeepSpeed's stage 0, no ZeRO" in lines["zero.stage"]
    assert "unused" in lines["zero.bucket_mb"]
    assert "'replicate'" in lines["strategy"]
    # with ZeRO on, the rows are DeepSpeed's values, as before
    p.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2}}))
    text = explain(p, world_size=2)
    assert "unused" not in text and " 2 " in text.split("zero.stage", 1)[1].splitlines()[0]
