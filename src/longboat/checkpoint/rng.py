"""Random number generator states as JSON: Python's ``random``, torch's CPU (and CUDA) generator,
and numpy's global one when numpy is installed."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """This process's RNG states, JSON-ready."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state().tolist(),
        "cuda": (
            [s.tolist() for s in torch.cuda.get_rng_state_all()]
            # torch.cuda.is_initialized is unannotated
            if torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            else None
        ),
        "numpy": None,
    }
    try:
        import numpy as np
    except ImportError:
        return state
    legacy = np.random.get_state(legacy=True)
    # A dict only for a bit generator other than MT19937; the global RandomState's is MT19937.
    assert isinstance(legacy, tuple)
    name, keys, pos, has_gauss, cached = legacy
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`capture` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in cuda])
    if state.get("numpy") is not None:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
