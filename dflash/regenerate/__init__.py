"""``dflash regenerate``: the data set's prompts answered by the target itself (ShareGPT JSONL out).

Why: DFlash's published recipe trains the drafter on replies *the target* wrote. ShareGPT's replies
came from another model, so a drafter trained on them learns a distribution the target never
produces, and acceptance length suffers. This package rewrites the assistant side of the configured
data set with the target's own replies and writes a file that ``dflash train`` reads like any data
set (``[workload] dataset = "DATA.jsonl"``).

The parts, one job each:

- :mod:`~dflash.regenerate.options`: the flags as :class:`Options`; the checks the CLI's option table
  cannot express (:func:`check_flags`, the verb's ``check``).
- :mod:`~dflash.regenerate.prompts`: which records are eligible and what each prompt is (``--turns``).
- :mod:`~dflash.regenerate.local`: the transformers back end (batched, left-padded ``generate``).
- :mod:`~dflash.regenerate.server`: the OpenAI-compatible server back end (the ``openai`` client).
- :mod:`~dflash.regenerate.writer`: whole-line resumable appends, the failed-prompt log.
- :mod:`~dflash.regenerate.sidecar`: the settings check and the per-run record beside the output.
- :mod:`~dflash.regenerate.progress`: counts and the throttled progress line.
- :mod:`~dflash.regenerate.run`: :func:`handle`, the verb as a sequence of those steps.

Decoding: greedy by default (``--temperature 0``); ``--temperature T > 0`` samples, with ``--top-p P``
as nucleus mass (no top-k, no repetition penalty, whatever the model's own generation config says:
the data should be the target's distribution at those settings). ``--max-new-tokens`` bounds each
reply (default ``workload.max_len``: nothing longer can be trained on).

Output: one JSON object per line, ``{"id", "conversations": [{"from": "system"|"human"|"gpt",
"value"}], "dflash": {"finish": [...], "new_tokens": [...]}}`` (``finish`` per reply: ``stop`` or
``length``; ``new_tokens`` may hold ``null`` when a server does not report usage; ``stopped:
"context"`` when ``--turns all`` ended a conversation early), beside it ``DATA.jsonl.meta.json`` and
``DATA.jsonl.failed.jsonl``. Importing this package imports neither torch nor openai.
"""

from __future__ import annotations

from dflash.regenerate.local import TransformersBackend, run_transformers, weights_fingerprint
from dflash.regenerate.options import Options, check_flags, options_from, server_base_url
from dflash.regenerate.progress import Progress
from dflash.regenerate.prompts import Job, Reply, Source, prompt_sources
from dflash.regenerate.run import handle
from dflash.regenerate.server import RequestFailed, ServerClient, run_server
from dflash.regenerate.sidecar import compare_settings
from dflash.regenerate.writer import FORMAT, Failure, Output, failed_path, inspect_output, record_line, sidecar_path

__all__ = [
    "FORMAT", "Failure", "Job", "Options", "Output", "Progress", "Reply", "RequestFailed", "ServerClient", "Source",
    "TransformersBackend", "check_flags", "compare_settings", "failed_path", "handle", "inspect_output",
    "options_from", "prompt_sources", "record_line", "run_server", "run_transformers", "server_base_url",
    "sidecar_path", "weights_fingerprint",
]
