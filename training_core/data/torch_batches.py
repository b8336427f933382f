"""PyTorch hand-off: NumPy batch → tensors without copying contiguous numeric columns."""
from __future__ import annotations

import numpy as np


def batch_to_torch(batch: dict[str, np.ndarray]) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """Convert numeric columns with ``torch.from_numpy`` (shares memory when contiguous & writable).

    Non-contiguous or read-only arrays are copied once (torch cannot alias them safely); object
    columns (strings, ragged lists) have no tensor form and raise ``TypeError`` naming the column.
    """
    import torch

    out = {}
    for name, array in batch.items():
        if array.dtype == object:
            raise TypeError(f"column {name!r} holds Python objects (strings or ragged lists); drop it or pad it first")
        if not array.flags.c_contiguous or not array.flags.writeable:
            array = np.ascontiguousarray(array).copy() if not array.flags.writeable else np.ascontiguousarray(array)
        out[name] = torch.from_numpy(array)
    return out
