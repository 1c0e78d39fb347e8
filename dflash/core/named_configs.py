"""docs/ARCHITECTURE.md's two named reference configurations, which every report places next to a tuned one.

``baseline`` is the setting before the reported change (min-ready 10, max depth 30: its old max depth
was not reported, 30 keeps the same 1:3 ratio); ``handpicked`` is the reported change (30/90). Both
run the default policy. This is their one definition: the sweep evaluates them, validation runs
them, the demo simulates them and reports recognise runs by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash.core.config import QueueConfig

NAMED_CONFIGS: dict[str, dict[str, int]] = {
    "baseline": {"min_ready": 10, "max_depth": 30},
    "handpicked": {"min_ready": 30, "max_depth": 90},
}
DEFAULT_POLICY: str = QueueConfig.policy  # the named configs run it; with another policy a run is not one


def named_config_of(queue: Mapping[str, Any] | None) -> str | None:
    """``baseline``/``handpicked`` when a queue (config dict or record) is one of the named configs."""
    if not queue:
        return None
    for name, knobs in NAMED_CONFIGS.items():
        if all(queue.get(k) == v for k, v in knobs.items()) and queue.get("policy", DEFAULT_POLICY) == DEFAULT_POLICY:
            return name
    return None
