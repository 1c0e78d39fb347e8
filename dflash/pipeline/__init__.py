"""The trainer: target and drafter workers around the queue, checkpoints, telemetry (W&B, NVML)."""
