"""The work behind the ``longboat plan`` command (the CLI only parses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longboat import config as lb_config
from longboat.plan.device import default_device
from longboat.plan.planner import ROLES, STRATEGIES, make_plan, one_line
from longboat.plan.render import parse_bytes, render
from longboat.plan.target import PlanInputError, Target, resolve, whole_model_params
from longboat.strategies.registry import zero_stage

DEFAULT_MICRO_BATCH = 8  # as longboat bench's


def accumulation_of(base: lb_config.Config, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step from ``base``'s batch triple at ``micro_batch`` on the
    data-parallel ranks of ``world_size`` (``train_batch_size / (micro x dp)``, or its
    ``gradient_accumulation_steps``; 1 when it sets neither). A triple that does not hold
    raises the config's own :class:`~longboat.config.ConfigError`, naming the keys. With
    pipeline stages and neither set, ``mesh.pp``."""
    from longboat.config.batch import resolve_batch
    from longboat.engine import resolve_mesh

    batch = base.batch
    if batch.train_batch_size is None:
        # A pipeline's default is the fewest micro-batches that fill its stages: 1F1B and
        # the interleaved schedule refuse fewer.
        return batch.gradient_accumulation_steps or base.mesh.pp
    if batch.micro_batch_size is not None and batch.gradient_accumulation_steps is not None:
        # All three given: the micro-batch may be --micro-batch's, so the accumulation is
        # derived again from the global batch.
        batch = batch.model_copy(update={"gradient_accumulation_steps": None})
    batch = batch.model_copy(update={"micro_batch_size": micro_batch})
    return resolve_batch(batch, resolve_mesh(base, world_size).dp).gradient_accumulation_steps


def run_plan(
    model: str,
    model_args: str | None,
    micro_batch: int | None,
    seq_len: int | None,
    world_size: int,
    precision: str | None,
    optimizer: str,
    budget: str | None,
    strategies: str | None,
    config_file: Path | None,
    as_json: bool,
    pp: int | None = None,
    micro_batches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    tp: int | None = None,
    sequence_parallel: bool | None = None,
    device: str | None = None,
) -> tuple[str, int]:
    """Plan and format; returns (text, exit status). Raises :class:`PlanInputError` or
    :class:`~longboat.config.ConfigError` for usage errors.

    Exit status 1 when no strategy is recommended because a budget was given and none fits
    it, or because strategies could not be planned for this model (a verdict, not a usage
    error: the table says why, [Note: unplanned rows] in ``planner.py``); 0 otherwise.

    ``micro_batch`` None: the config's ``batch.micro_batch_size``, else 8. ``micro_batches``
    (micro-batches per optimizer step) None: what the config's batch triple gives at the
    world size's data-parallel ranks (:func:`accumulation_of`), else 1. ``device`` None: where
    a run here would train (:func:`~longboat.plan.device.default_device`).
    """
    kwargs: dict[str, Any] = {}
    if model_args:
        try:
            kwargs = json.loads(model_args)
        except json.JSONDecodeError as e:
            raise PlanInputError(
                f"--model-args is not JSON ({e}); write e.g. '{{\"d_model\": 1024}}'"
            ) from None
        if not isinstance(kwargs, dict):
            raise PlanInputError("--model-args must be a JSON object of keyword arguments")
    if config_file is not None and not config_file.is_file():
        raise PlanInputError(
            f"config file {str(config_file)!r} does not exist: give the path of a file"
        )
    base = lb_config.load_config(config_file)
    for flag, value in (("--pp", pp), ("--micro-batches", micro_batches), ("--tp", tp)):
        if value is not None and value < 1:
            raise PlanInputError(f"{flag} {value} is invalid: use 1 or more")
    overrides = {
        ("precision", "dtype"): precision,
        ("mesh", "pp"): pp,
        ("mesh", "tp"): tp,
        ("tensor_parallel", "sequence_parallel"): sequence_parallel,
        ("batch", "gradient_accumulation_steps"): micro_batches,
        ("pipeline", "schedule"): schedule,
        ("pipeline", "virtual_stages"): virtual_stages,
    }
    if any(v is not None for v in overrides.values()):
        # Through validation again: fp16-only keys must still agree, schedules be known.
        data = base.model_dump(exclude_unset=True)
        for (section, key), given in overrides.items():
            if given is not None:
                data.setdefault(section, {})[key] = given
        base = lb_config.load_config(data)
    if micro_batch is None:
        micro_batch = base.batch.micro_batch_size or DEFAULT_MICRO_BATCH
    if micro_batches is None:
        base = base.model_copy(
            update={
                "batch": base.batch.model_copy(
                    update={
                        "gradient_accumulation_steps": accumulation_of(
                            base, micro_batch, world_size
                        )
                    }
                )
            }
        )
    # "zero2" as `longboat bench` spells it is accepted too.
    names = (
        tuple(
            f"zero-{stage}" if (stage := zero_stage(s)) else s.strip()
            for s in strategies.split(",")
        )
        if strategies
        else STRATEGIES
    )
    if not strategies and base.strategy in ROLES:  # see [Note: planning roles]
        names = (*names, base.strategy)
    target = resolve(model, kwargs, seq_len)
    _check_builds(target, kwargs)
    plan = make_plan(
        target,
        base,
        world_size,
        micro_batch,
        optimizer,
        names,
        parse_bytes(budget) if budget else None,
        try_offload=not strategies,  # the user's own list is the user's choice
        device=device or default_device(),
    )
    text = json.dumps(plan.to_json(), indent=2) if as_json else render(plan)
    unplanned = any(s.error for s in plan.strategies)
    verdict = plan.recommended is None and (plan.budget is not None or unplanned)
    return text, 1 if verdict else 0


def _check_builds(target: Target, kwargs: dict[str, Any]) -> None:
    """Build the model once (on fake tensors, as every row does) so that a model that cannot
    be built is one usage error, not the same failure in every row."""
    try:
        whole_model_params(target)
    except PlanInputError:
        raise
    except TypeError as e:  # most often the constructor refusing the arguments
        raise PlanInputError(
            f"--model {target.name!r} with --model-args {kwargs}: {one_line(e)}"
        ) from None
    except Exception as e:
        raise PlanInputError(
            f"--model {target.name!r}: building the model failed: {one_line(e)}"
        ) from None
