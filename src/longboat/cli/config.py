"""``longboat config explain``: every resolved value of a config and where it came from."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from longboat.cli import options
from longboat.cli.app import config_app, usage_error


@config_app.command("explain")
def config_explain(
    file: Path = typer.Argument(
        ..., metavar="FILE", help="a longboat TOML/JSON/YAML or DeepSpeed JSON config"
    ),
    world_size: int = typer.Option(1, "--world-size", help="number of ranks to explain it for"),
    model: str | None = typer.Option(
        None,
        "--model",
        help="with mesh.pp > 1: show the layers each pipeline stage holds of this model "
        f"({options.MODEL.help})",
    ),
    model_args: str | None = typer.Option(
        None, "--model-args", help="JSON keyword arguments for --model"
    ),
    trainer_arg: list[str] = typer.Option(
        [],
        "--trainer-arg",
        metavar="NAME=VALUE",
        help="a Hugging Face TrainingArguments value that the config's 'auto' values resolve "
        "from (repeatable), e.g. per_device_train_batch_size=8",
    ),
) -> None:
    """Show the resolved configuration and how derived values (the batch triple) follow;
    with ``--model``, the layers and parameters of each pipeline stage."""
    from longboat import config

    if not file.is_file():
        raise usage_error(f"config file {str(file)!r} does not exist: give the path of a file")
    if world_size < 1:
        raise usage_error(f"--world-size {world_size} is invalid: use 1 or more")
    try:
        text = config.explain(file, world_size, _trainer_args(trainer_arg))
        if model is not None:
            text += "\n" + _stages(file, world_size, model, model_args)
    except config.ConfigError as e:
        raise usage_error(str(e)) from None
    print(text)


def _trainer_args(pairs: list[str]) -> dict[str, object]:
    """``NAME=VALUE`` pairs; a value is read as JSON (numbers, true/false), else as text."""
    out: dict[str, object] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise usage_error(f"--trainer-arg {pair!r} is invalid: write NAME=VALUE")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def _stages(file: Path, world_size: int, spec: str, model_args: str | None) -> str:
    """The pipeline stages of ``spec`` under the config's mesh and partition (built on the meta
    device: nothing is allocated)."""
    import torch

    from longboat import config
    from longboat.engine import resolve_mesh
    from longboat.pipeline import PartitionError, stages
    from longboat.plan.target import PlanInputError, resolve

    cfg = config.load(file).config
    mesh = resolve_mesh(cfg, world_size)
    if mesh.pp == 1:
        return "pipeline: mesh.pp = 1, no stages (every rank holds the whole model)"
    try:
        kwargs = json.loads(model_args) if model_args else None
    except json.JSONDecodeError as e:
        raise usage_error(f"--model-args is not JSON ({e}): e.g. '{{\"d_model\": 1024}}'") from None
    n = mesh.pp * cfg.pipeline.virtual_stages
    try:
        with torch.device("meta"):
            built = resolve(spec, kwargs).build()
        layers = stages.as_layers(built, cfg.pipeline.partition)
        method = stages.requested(layers, cfg.pipeline.partition)
        # nothing is timed here: a split by measured time is shown by parameters instead
        timed = stages.measures(method)
        _, info = stages.plan(layers, n, "parameters" if timed else method)
    except (PlanInputError, PartitionError, TypeError) as e:
        raise usage_error(f"--model {spec}: {e}") from None
    head = (
        f"pipeline of {spec}: {n} stages (mesh.pp = {mesh.pp} x pipeline.virtual_stages = "
        f"{cfg.pipeline.virtual_stages}); stage s runs on pipeline rank s % {mesh.pp}:"
    )
    lines = [head, *(f"  {s.describe()}" for s in info)]
    if timed:
        lines.append(
            "  (split by parameters here; a run given example_input splits by each layer's "
            "measured time, logged at its start)"
        )
    return "\n".join(lines)
