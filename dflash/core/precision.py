"""The trainer's precision rule, in one place for the trainer and for calibration.

On CUDA the drafter trains fp32 master weights under bf16 autocast and the queued hidden states
are bf16 (half the queue memory and transfer bytes); on the CPU both are fp32, because CPU bf16
matmuls are slower than fp32 ones. Calibration needs the same rule to turn a run's measured bytes
per padded token back into a hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable


def autocast_on(device_type: str) -> bool:
    return device_type == "cuda"


def state_dtype_name(device_type: str) -> str:
    """The torch dtype name of the queued hidden states on a drafter of this device type."""
    return "bfloat16" if autocast_on(device_type) else "float32"


def state_dtype_bytes(devices: Iterable[str]) -> int:
    """Bytes per element of the queued states of a run whose drafters sit on ``devices``."""
    return 2 if any(autocast_on(d.split(":")[0]) for d in devices) else 4
