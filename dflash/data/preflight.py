"""Checks a verb runs on its data inputs before it starts any work (or any process).

Training starts one process per rank, and each rank loads the data set and the target itself; a
data set with no usable conversation or a model directory without a model would then fail inside
every rank. :func:`check_data_inputs` reads the same inputs the same way in the launching process,
so such input is one line (a :class:`~dflash.core.errors.ConfigError`) before anything starts.
"""

from __future__ import annotations

from dflash.core.config import WorkloadConfig
from dflash.data.conversations import ParseStats, load_conversations, resolve_dataset, say_damaged
from dflash.data.model_source import check_model


def check_data_inputs(workload: WorkloadConfig, model: str) -> ParseStats:
    """Resolve the target model's path and parse the data set once; returns the parse statistics.

    Raises ConfigError naming ``target.model`` (a path that names nothing, a file that is no model,
    a directory without a config or weights, a hub id whose config cannot be fetched) or
    ``workload.dataset`` (missing, unreadable, no usable conversation); damaged records are counted
    and said once, here (the ranks that read the file again stay quiet).
    """
    check_model(model)
    path = resolve_dataset(workload.dataset, model)
    _, stats = load_conversations(path, workload.sample, workload.max_conversations)
    say_damaged(path, stats)
    return stats
