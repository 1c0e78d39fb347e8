"""Data sets: ShareGPT conversations (:mod:`.conversations`), finding a model and its tokenizer
(:mod:`.model_source`) and the token-length cache (:mod:`.lengths`).

It imports the core and a tokenizer, never ``dflash.model``: the length cache must be buildable
and readable without loading a model (docs/ARCHITECTURE.md, "Layering"). The names below are the
old ``dflash.data`` module's, kept so scripts importing them from here keep working.
"""

from dflash.data.conversations import (
    Conversation,
    ParseStats,
    load_conversations,
    packaged_sharegpt_path,
    parse_conversations,
    resolve_dataset,
)

__all__ = ["Conversation", "ParseStats", "load_conversations", "packaged_sharegpt_path", "parse_conversations",
           "resolve_dataset"]
