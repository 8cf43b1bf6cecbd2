"""What a GPU run showed and a CPU can still check: gloo's point-to-point messages of CUDA
tensors go through a host copy ([Note: gloo point-to-point on accelerators] in
``longboat/comm/messages.py``), and NCCL with more ranks than GPUs on a node is refused
before the first collective. ``benchmarks/gpu_check.py`` runs both on a GPU (pipeline stages
over gloo with CUDA tensors; ``longboat run -n 2`` on one GPU)."""

from __future__ import annotations

import pytest
import torch

from longboat.comm.messages import Staged
from longboat.config import ConfigError
from longboat.world import World, init_process_group


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def is_completed(self) -> bool:
        return self.waited > 0

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        return True


def test_a_staged_recv_lands_on_its_tensor_once_and_a_send_keeps_its_copy():
    host, target = torch.arange(4.0), torch.zeros(4)
    work = _Work()
    recv = Staged(work, host, target)
    assert not recv.is_completed() and target.sum() == 0  # nothing lands before the wait
    assert recv.wait()
    assert torch.equal(target, host)
    host.fill_(9.0)
    recv.wait()  # a second wait copies nothing again
    assert torch.equal(target, torch.arange(4.0)) and work.waited == 2
    send = Staged(_Work(), torch.ones(2), None)
    assert send.wait() and send._host is not None  # the copy lives as long as the handle


def test_nccl_with_more_ranks_than_gpus_on_a_node_is_refused_by_name(monkeypatch):
    # Seen on a one-GPU machine: NCCL fails only at the first collective, as "invalid usage".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    world = World(rank=0, world_size=2, local_world_size=2)
    with pytest.raises(
        ConfigError, match=r"2 ranks on this node and 1 GPU.*comm\.backend = 'gloo'"
    ):
        init_process_group(world, backend="nccl")
    with pytest.raises(ConfigError, match=r"NCCL needs a GPU of its own"):
        init_process_group(world, backend="auto")  # auto means NCCL where CUDA is usable
