"""What the records are made from: the eligible prompts of the data set and the record in the making.

A record is eligible when, after optional system turns, it opens with a non-empty user turn (and, as
:mod:`dflash.data.conversations` reads conversations, has at least one assistant turn); records that
open with an assistant turn (ShareGPT's split continuations, about a third of the packaged file) are
skipped, because their first question answers context written by another model. ``--turns first``:
the first user turn (and the system turns before it) is the prompt. ``--turns all``: every non-empty
user turn in order, each asked with the conversation so far, in which the earlier replies are the
*regenerated* ones (the original assistant turns are dropped entirely), so the context the target
sees is its own. Duplicate ids get a ``#dupK`` suffix so every record has a unique id (the resume
key). A record is written once all its turns are answered. Torch-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dflash.data.conversations import Conversation

TURNS = ("first", "all")


@dataclass(frozen=True)
class Source:
    """What one output record is made from: its id, leading system turns and the user turns to answer."""

    id: str
    system: tuple[str, ...]
    user_turns: tuple[str, ...]


def prompt_sources(conversations: Iterable[Conversation], turns: str) -> tuple[list[Source], int]:
    """Eligible records in data-set order (module docstring), with unique ids; and how many were not."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    out: list[Source] = []
    seen: Counter[str] = Counter()
    ineligible = 0
    for conv in conversations:
        msgs = list(conv.messages)
        i = 0
        while i < len(msgs) and msgs[i][0] == "system":
            i += 1
        if i >= len(msgs) or msgs[i][0] != "user" or not msgs[i][1].strip():
            ineligible += 1
            continue
        if turns == "first":
            users: tuple[str, ...] = (msgs[i][1],)
        else:
            users = tuple(c for r, c in msgs[i:] if r == "user" and c.strip())
        seen[conv.id] += 1
        rid = conv.id if seen[conv.id] == 1 else f"{conv.id}#dup{seen[conv.id]}"
        out.append(Source(rid, tuple(c for _, c in msgs[:i]), users))
    return out, ineligible


@dataclass(frozen=True)
class Reply:
    """One generated reply. ``tokens``: new tokens (EOS included), None when a server does not say."""

    text: str
    tokens: int | None
    finish: str  # "stop" | "length" (or whatever the server reported)
    token_ids: tuple[int, ...] | None = None


class Job:
    """One record in the making: the conversation so far (with regenerated replies) and what is left."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.context: list[dict[str, str]] = [{"role": "system", "content": s} for s in source.system]
        self.turn = 0
        self.finish: list[str] = []
        self.new_tokens: list[int | None] = []
        self.stopped: str | None = None

    @property
    def done(self) -> bool:
        return self.stopped is not None or self.turn >= len(self.source.user_turns)

    def next_messages(self) -> list[dict[str, str]]:
        """The messages of the next request: everything so far plus the next user turn."""
        return [*self.context, {"role": "user", "content": self.source.user_turns[self.turn]}]

    def advance(self, reply: Reply) -> None:
        self.context.append({"role": "user", "content": self.source.user_turns[self.turn]})
        self.context.append({"role": "assistant", "content": reply.text})
        self.finish.append(reply.finish)
        self.new_tokens.append(reply.tokens)
        self.turn += 1

    def stop(self, why: str) -> None:
        self.stopped = why

    @property
    def replies(self) -> int:
        return self.turn

    def record(self) -> dict[str, Any]:
        """The ShareGPT record of the replies so far (``dflash`` holds per-reply metadata)."""
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        conv = [{"from": names[m["role"]], "value": m["content"]} for m in self.context]
        meta: dict[str, Any] = {"finish": self.finish, "new_tokens": self.new_tokens}
        if self.stopped is not None and self.turn < len(self.source.user_turns):
            meta["stopped"] = self.stopped
            meta["user_turns_left"] = len(self.source.user_turns) - self.turn
        return {"id": self.source.id, "conversations": conv, "dflash": meta}
