"""Live tensor bytes over time, counted from the storages that operators create.

A :class:`LiveBytes` dispatch mode sees every operator's outputs. Each new storage is counted
once, when it first appears, and uncounted when Python frees it (a weak reference's callback);
views share their base's storage and add nothing; a storage resized in place (ZeRO-3's freed
buffers, [Note: storage resize] in ``strategies/zero/storage.py``) counts its new size. On fake
(meta) tensors this gives, without allocating anything, the bytes a real run would hold at
every moment: its peak is what the caching allocator (GPU) or ``malloc`` (CPU) must provide for
tensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_RESIZE = getattr(
    getattr(getattr(torch.ops, "inductor", None), "resize_storage_bytes_", None), "default", None
)


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's is unannotated
    """Track the bytes of live tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's is unannotated
        self.live = 0
        self.peak = 0  # since the last reset_peak()
        self.max_peak = 0  # since the mode was created
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._size: dict[int, int] = {}  # bytes counted for each live storage
        # Beside an accelerator, what is in host memory ([Note: planning host offload] in
        # placement.py): counted apart, never in ``live`` and the peaks above.
        self._host: set[int] = set()  # keys of host storages
        self.host_live = 0
        self.host_peak = 0

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _track(self, t: torch.Tensor, host: bool = False) -> None:
        st = t.untyped_storage()
        key = id(st)
        ref = self._refs.get(key)
        if ref is not None and ref() is st:
            return  # a view of (or the same) storage already counted
        n = st.nbytes()

        def gone(_ref: Any, key: int = key) -> None:
            if self._refs.get(key) is _ref:
                del self._refs[key]
                self._add(-self._size.pop(key), key in self._host)
                self._host.discard(key)

        self._refs[key] = weakref.ref(st, gone)
        self._size[key] = n
        if host:
            self._host.add(key)
        self._add(n, host)

    def _add(self, n: int, host: bool = False) -> None:
        if host:
            self.host_live += n
            self.host_peak = max(self.host_peak, self.host_live)
            return
        self.live += n
        self.peak = max(self.peak, self.live)
        self.max_peak = max(self.max_peak, self.live)

    def mark_host(self, t: torch.Tensor) -> None:
        """``t``'s storage is in host memory beside the accelerator: count it there, and what
        operators make from it ([Note: planning host offload] in ``placement.py``)."""
        self._place(t, host=True)

    def mark_device(self, t: torch.Tensor) -> None:
        """``t``'s storage went to the accelerator: count it there (what was in host memory is
        no longer)."""
        self._place(t, host=False)

    def _place(self, t: torch.Tensor, host: bool) -> None:
        st = t.untyped_storage()
        key = id(st)
        ref = self._refs.get(key)
        if ref is None or ref() is not st:
            self._track(t, host)
        elif (key in self._host) != host:
            n = self._size[key]
            self._add(-n, not host)
            if host:
                self._host.add(key)
            else:
                self._host.discard(key)
            self._add(n, host)

    def restart_peaks(self) -> None:
        """Count the peaks from what is live now (device and host)."""
        self.peak = self.max_peak = self.live
        self.host_peak = self.host_live

    def _from_host(self, args: Any, kwargs: Any) -> bool:
        """Whether an operator reads a host buffer: what it makes is then on the host too (a
        host scalar beside device tensors is not: torch computes such an operator on the
        device)."""
        if not self._host:
            return False
        return any(
            isinstance(a, torch.Tensor) and a.dim() > 0 and id(a.untyped_storage()) in self._host
            for a in tree_leaves((args, kwargs or {}))
        )

    def _resized(self, t: torch.Tensor) -> None:
        """``t``'s storage changed size in place: count its new size."""
        st = t.untyped_storage()
        key = id(st)
        ref = self._refs.get(key)
        if ref is None or ref() is not st:
            self._track(t)  # not seen before (made outside the mode)
            return
        n = st.nbytes()
        self._add(n - self._size[key], key in self._host)
        self._size[key] = n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            # A fake tensor has no value, but the engine reads the loss as a number and torch's
            # optimizers read their step count; 1 suits both (Adam divides by 1 - beta**step,
            # so 0 would not). See [Note: fake tensors] in simulate.py.
            return 1
        out = func(*args, **(kwargs or {}))
        if func is _RESIZE:
            self._resized(args[0])
            return out
        host = self._from_host(args, kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, host)
        return out
