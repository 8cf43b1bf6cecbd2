"""The sections that say how each rank computes: precision and loss scaling, activation
recomputation and ``torch.compile``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from longboat.config.sections_base import _Section

_FP16_ONLY = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


class PrecisionConfig(_Section):
    """Compute precision: the forward runs under autocast in ``dtype`` with the model's fp32
    parameters as master weights; fp16 adds loss scaling (DeepSpeed's rules, see
    :mod:`longboat.precision`)."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = Field(0.0, ge=0, description="fp16: 0 = dynamic, > 0 = this static scale")
    initial_scale_power: int = Field(
        16, ge=0, le=127, description="fp16 dynamic: the scale starts at 2**initial_scale_power"
    )
    loss_scale_window: int = Field(
        1000, gt=0, description="fp16 dynamic: steps in a row without overflow before it doubles"
    )
    hysteresis: int = Field(
        2,
        ge=1,
        description="fp16 dynamic: overflows tolerated before the scale halves "
        "(the hysteresis-th halves it; refilled when the scale doubles)",
    )
    min_loss_scale: float = Field(
        1.0, gt=0, description="fp16 dynamic: never halve below this; an overflow there is an error"
    )
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="dtype gradients travel in between ranks (replicate, ZeRO); None = their "
        "own dtype (fp32, or param_dtype's)",
    )
    param_dtype: Literal["fp32", "bf16"] | None = Field(
        None,
        description="ZeRO (any stage): the dtype parameters are kept, gathered and computed in "
        "(FSDP2's MixedPrecisionPolicy.param_dtype, DeepSpeed's bf16 model), half the "
        "all-gather bytes in bf16; the optimizer keeps stepping fp32 master shards, and "
        "checkpoints hold them. None = the parameters' own dtype",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="FSDP2's name for communication_data_type: the dtype gradients are "
        "reduced in (with param_dtype = 'bf16', set 'fp32' to reduce in fp32)",
    )

    def wire_dtype(self) -> str | None:
        """The dtype gradients travel in: ``reduce_dtype`` or ``communication_data_type``
        (the table of compositions refuses the two set apart)."""
        return self.reduce_dtype or self.communication_data_type

    @model_validator(mode="after")
    def _fp16_keys_need_fp16(self) -> PrecisionConfig:
        stray = [k for k in _FP16_ONLY if k in self.model_fields_set]
        if stray and self.dtype != "fp16":
            keys = ", ".join(f"precision.{k}" for k in stray)
            raise ValueError(
                f"{keys}: only for dtype 'fp16' (dtype is {self.dtype!r}); remove "
                "or set precision.dtype = 'fp16'"
            )
        return self


class ActivationCheckpointingConfig(_Section):
    """Modules whose activations are recomputed in backward instead of kept
    (``longboat.recompute``)."""

    classes: list[str] = Field(
        default_factory=list, description="module class names to recompute, e.g. ['Block']"
    )
    every: int = Field(1, ge=1, description="recompute every k-th matching module (1: all)")
    cpu_checkpointing: bool = Field(
        False,
        description="keep the recomputed modules' inputs in CPU memory between forward and "
        "backward on an accelerator (torch.autograd.graph.save_on_cpu; DeepSpeed's key); "
        "no effect on a CPU device",
    )


class CompileConfig(_Section):
    """``torch.compile`` applied by longboat, block by block, after the strategy is set up
    (``longboat/compile.py``, docs/compile.md). ``compile = true`` is short for
    ``[compile] enabled = true``. The other keys go to ``torch.compile`` as they are."""

    enabled: bool = False
    backend: str = Field("inductor", description="a torch.compile backend name (aot_eager, ...)")
    mode: str | None = Field(
        None,
        description="torch.compile's mode: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs (checked by torch at initialize)",
    )
    fullgraph: bool = Field(
        False, description="each compiled block must be one graph (an error at a graph break)"
    )
    dynamic: bool | None = Field(
        None, description="dynamic shapes: None lets torch decide (on a shape change)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="backend options (inductor's config), not with mode"
    )
    classes: list[str] = Field(
        default_factory=list,
        description="module class names compiled one by one (e.g. ['Block']); empty = ZeRO-3's "
        "units, else the blocks the model declares (_no_split_modules), else the whole model",
    )

    @model_validator(mode="after")
    def _mode_or_options(self) -> CompileConfig:
        if self.mode is not None and self.options:
            raise ValueError(
                f"compile.mode = {self.mode!r} with compile.options: torch.compile takes one "
                "of the two (a mode is a set of options); remove one"
            )
        return self
