"""The control plane's messages: one small frozen dataclass each, one encoder, one decoder.

Why typed: the coordinator and the ranks exchange fourteen kinds of message (docs/ARCHITECTURE.md,
"Control messages", says who sends each and when). As dicts dispatched by an ``op`` string, a
misspelt key or a message sent the wrong way surfaced as a ``KeyError`` deep in a loop, far from the
rank that sent it. Here every message names its fields and their types; :func:`decode` checks a
received message against its class and, when it is unknown, sent the wrong way or malformed, raises
:class:`ProtocolError` naming the sender. The receivers then dispatch on the class (``match``), never
on a string.

The wire form (:func:`encode`) is ``(tag, fields)`` with the fields as a dict, pickled by
:mod:`dflash.pipeline.channel`; nested values (:class:`ItemMeta`, :class:`Incoming`, :class:`TakeReport`,
:class:`dflash.pipeline.transport.TensorMeta`) travel as themselves. The control plane never carries
tensors: shapes travel in :class:`ItemMeta`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from dflash.model.hostsync import HostMasks
from dflash.pipeline.transport import TensorMeta


class ProtocolError(RuntimeError):
    """A control message that is unknown, sent the wrong way or malformed (the message names its sender)."""


# ------------------------------------------------------------------ parts of messages
@dataclass(frozen=True, slots=True)
class ItemMeta:
    """What a drafter needs to receive an item: its tensors' shapes and dtypes, and (with check_transfers)
    a content fingerprint to recompute on arrival; ``host``: the item's masks as runs, so the drafter plans
    its step on the host without reading the device (issue 34)."""

    tensors: tuple[TensorMeta, ...]
    fingerprint: str | None = None
    host: HostMasks | None = None


@dataclass(frozen=True, slots=True)
class Incoming:
    """One item a drafter receives in global round ``round`` from producer rank ``src``."""

    round: int
    item_id: str
    src: int
    meta: ItemMeta


@dataclass(frozen=True, slots=True)
class TakeReport:
    """What a drafter trained of one take (the take record's measured fields)."""

    item_ids: tuple[str, ...]
    compute_s: float
    transfer_s: float
    bytes: int
    tokens: int
    n_seqs: int
    anchors: int
    counted_tokens: int

    RECORD_FIELDS: ClassVar[tuple[str, ...]] = ("compute_s", "transfer_s", "bytes", "tokens", "n_seqs", "anchors",
                                                "counted_tokens")

    def record_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RECORD_FIELDS}


# ------------------------------------------------------------------ rank -> coordinator
@dataclass(frozen=True, slots=True)
class Hello:
    """Every rank, once, right after it connects: who it is."""

    rank: int


@dataclass(frozen=True, slots=True)
class NextItem:
    """A producer asks for its first item id (later ones come with each admit)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """A producer computed an item and holds its tensors: id, size, shapes, compute time."""

    item_id: str
    nbytes: int
    meta: ItemMeta
    compute_s: float
    stages: dict[str, float]
    pid: int
    gpu: list[dict[str, Any]]
    host: str  # the producer's hostname and device, into its produce records (placement-priced calibration)
    device: str


@dataclass(frozen=True, slots=True)
class Closed:
    """A producer's feed is exhausted: it computes nothing more and waits for the end of the run."""


@dataclass(frozen=True, slots=True)
class Request:
    """A drafter asks for its take of optimizer step ``step``."""

    step: int


@dataclass(frozen=True, slots=True)
class Done:
    """A drafter finished ``step``: what it trained; the host rank adds the step record's fields."""

    step: int
    pid: int
    takes: tuple[TakeReport, ...]
    stages: dict[str, float]
    step_info: dict[str, Any] | None
    gpu: list[dict[str, Any]]
    skipped: bool
    host: str  # the drafter's hostname and device, into its take records (placement-priced calibration)
    device: str


@dataclass(frozen=True, slots=True)
class Bye:
    """A rank's last word: a drafter after its last step (the host rank with the run's summary fields),
    a producer after stop (with its send time and bytes)."""

    summary: dict[str, Any] | None = None
    send_s: float | None = None
    sent_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Beat:
    """Every rank, every second (dflash.pipeline.abort.Heartbeat): it is alive. A rank silent for the
    heartbeat timeout is dead, though its socket never closed (a killed host, a cut network)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A failing rank's last word, best effort (dflash.pipeline.rank.rank_main): its one-line error. The
    coordinator then fails with it as the cause and closes every channel, so the other ranks leave at once."""

    line: str


# ------------------------------------------------------------------ coordinator -> rank
@dataclass(frozen=True, slots=True)
class Admit:
    """To a producer: your last item is queued (or this is the start); compute ``next`` (None: the feed is
    exhausted, close)."""

    next: str | None


@dataclass(frozen=True, slots=True)
class Send:
    """To a producer: post item ``item_id`` to drafter rank ``dst`` in global round ``round``."""

    round: int
    item_id: str
    dst: int


@dataclass(frozen=True, slots=True)
class Stop:
    """To a producer: the run is over (its held items are discarded); say bye."""


@dataclass(frozen=True, slots=True)
class Assign:
    """To a drafter: its take of ``step``, as the items to receive in their rounds."""

    step: int | None
    transfers: tuple[Incoming, ...]


@dataclass(frozen=True, slots=True)
class NoWork:
    """To a drafter: nothing for ``step`` (the queue is drained or the run stopped)."""

    step: int | None


ToCoordinator = Hello | NextItem | Ready | Closed | Request | Done | Bye | Beat | Failed
ToRank = Admit | Send | Stop | Assign | NoWork
Message = ToCoordinator | ToRank

TO_COORDINATOR: tuple[type, ...] = (Hello, NextItem, Ready, Closed, Request, Done, Bye, Beat, Failed)
TO_RANK: tuple[type, ...] = (Admit, Send, Stop, Assign, NoWork)
_BY_TAG: dict[str, type] = {cls.__name__: cls for cls in (*TO_COORDINATOR, *TO_RANK)}
_PARTS = (ItemMeta, Incoming, TakeReport, TensorMeta)
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in (*_BY_TAG.values(), *_PARTS)}


def encode(msg: Message) -> tuple[str, dict[str, Any]]:
    """The wire form: the class's name and its fields (nested parts stay objects; the channel pickles)."""
    if type(msg) not in _HINTS or type(msg) in _PARTS:
        raise TypeError(f"not a control message: {msg!r}")
    return type(msg).__name__, {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def decode(wire: Any, sender: str, accepts: tuple[type, ...]) -> Message:
    """A received wire form back to its message, checked; :class:`ProtocolError` naming ``sender`` when the
    message is unknown, not one this end accepts, or has missing, extra or mistyped fields."""
    if not (isinstance(wire, tuple) and len(wire) == 2 and isinstance(wire[0], str) and isinstance(wire[1], dict)):
        raise ProtocolError(f"malformed control message from {sender}: {_short(wire)}")
    tag, fields = wire
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown control message {tag!r} from {sender} (known: {', '.join(sorted(_BY_TAG))})")
    if cls not in accepts:
        raise ProtocolError(f"control message {tag} from {sender} goes the other way (this end accepts "
                            f"{', '.join(c.__name__ for c in accepts)})")
    problem = _fields_problem(cls, fields)
    if problem is not None:
        raise ProtocolError(f"malformed control message {tag} from {sender}: {problem}")
    return cls(**fields)


def _fields_problem(cls: type, fields: dict[str, Any]) -> str | None:
    hints = _HINTS[cls]
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in fields]
    extra = sorted(set(fields) - set(names))
    if missing or extra:
        return "; ".join(p for p in (missing and f"missing {', '.join(missing)}",
                                     extra and f"unexpected {', '.join(map(str, extra))}") if p)
    for name, value in fields.items():
        if not _conforms(value, hints[name]):
            return f"{name} = {_short(value)} is not {_type_name(hints[name])}"
    return None


def _conforms(value: Any, hint: Any) -> bool:
    """A shallow-but-nested type check of the hints used above (no generic machinery beyond them)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(args) == len(value) and all(_conforms(v, a) for v, a in zip(value, args, strict=True))
    if origin is list:
        (arg,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, arg) for v in value)
    if origin is dict:
        key, val = typing.get_args(hint)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, val) for k, v in value.items())
    if isinstance(hint, type):
        if hint in _HINTS:  # a nested part: its own fields are checked too
            return isinstance(value, hint) and all(_conforms(getattr(value, f.name), _HINTS[hint][f.name])
                                                   for f in dataclasses.fields(hint))
        return isinstance(value, hint)
    return False


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


__all__ = ["TO_COORDINATOR", "TO_RANK", "Admit", "Assign", "Beat", "Bye", "Closed", "Done", "Failed", "Hello",
           "Incoming", "ItemMeta", "Message", "NextItem", "NoWork", "ProtocolError", "Ready", "Request", "Send", "Stop",
           "TakeReport", "ToCoordinator", "ToRank", "decode", "encode"]
