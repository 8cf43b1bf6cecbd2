"""What a doorway accepts under [Note: NCCL rules] (in ``comm/collectives.py``): gloo takes
tensors NCCL would refuse, so a CPU test checks them against these rules instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The environment variable that turns :class:`Rules` on ([Note: NCCL rules]).
NCCL_RULES_VAR = "LONGBOAT_NCCL_RULES"


class RulesError(RuntimeError):
    """A tensor this plane would refuse under NCCL ([Note: NCCL rules])."""


@dataclass(frozen=True)
class Rules:
    """What a doorway accepts ([Note: NCCL rules]): the data plane only tensors on ``device``;
    the control plane (``device`` None) only CPU tensors of at most ``max_bytes``."""

    device: torch.device | None = None
    max_bytes: int = 16 * 2**20

    def check(self, op: str, tensors: tuple[torch.Tensor, ...], group: str) -> None:
        for t in tensors:
            if self.device is not None:
                if t.device != self.device:
                    raise RulesError(
                        f"{op} on the data plane ({group}) got a tensor on {t.device}, not on "
                        f"the model's device {self.device}: NCCL would refuse it. Make it on "
                        "the model's device, or send what the CPU must read through the "
                        "control plane"
                    )
            elif t.device.type != "cpu" or t.numel() * t.element_size() > self.max_bytes:
                raise RulesError(
                    f"{op} on the control plane ({group}) got a {t.device} tensor of "
                    f"{t.numel() * t.element_size():,} bytes: the control plane carries small "
                    f"CPU tensors (at most {self.max_bytes:,} bytes); tensors of the model "
                    "belong on the data plane"
                )
