"""Host values onto the device without waiting for the stream.

A host-to-device copy from pageable memory synchronises the host with the stream: made after a
forward is queued, it holds every later launch until the forward has run. Through pinned memory
the copy is queued like a kernel and the host goes on (torch's pinned allocator keeps the buffer
until the copy has run). On a CPU device the values are simply a tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (an array, a tensor or a list) as a tensor on ``device``, queued, not awaited."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.as_tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
