"""``dflash regenerate``: the data set's prompts answered by the target itself (ShareGPT JSONL out).

Why: DFlash's published recipe trains the drafter on replies *the target* wrote. ShareGPT's replies
came from another model, so a drafter trained on them learns a distribution the target never
produces, and acceptance length suffers. This module rewrites the assistant side of the configured
data set with the target's own replies and writes a file that ``dflash train`` reads like any data
set (``[workload] dataset = "DATA.jsonl"``).

**Prompts.** The configured data set (``workload.dataset``, at most ``workload.max_conversations``
records) is read whole (``sample = "conversation"``, whatever ``workload.sample`` says: ``--turns``
decides). A record is eligible when, after optional system turns, it opens with a non-empty user
turn (and, as :mod:`dflash.data.conversations` reads conversations, has at least one assistant turn); records that
open with an assistant turn (ShareGPT's split continuations, about a third of the packaged file)
are skipped, because their first question answers context written by another model.
``--turns first``: the first user turn (and the system turns before it) is the prompt.
``--turns all``: every non-empty user turn in order, each asked with the conversation so far, in
which the earlier replies are the *regenerated* ones (the original assistant turns are dropped
entirely), so the context the target sees is its own. ``--limit N`` takes the first N eligible
records in data-set order, done ones included, so a rerun with the same ``--limit`` finishes the
same set and a larger one extends it. Duplicate ids get a ``#dupK`` suffix so every record has a
unique id (the resume key).

**Back ends.** ``transformers`` (default): the target (``target.model``, float32 on the CPU,
bfloat16 on CUDA) runs ``generate`` on batches of ``--batch-size`` prompts, left-padded with an
attention mask, on ``--device`` (default: the first of ``target.devices``); each batch is the
shortest prompts of a pool of eight batches' worth (:func:`run_transformers`: less padding), and a
``--turns all`` record rejoins the pool with its next turn. Prompts are rendered
with the target's chat template and the generation prompt (:func:`dflash.model.acceptance.render_prompt`,
never shortened); a prompt of ``workload.max_len`` tokens or more is skipped and counted, because
the trainer truncates every sequence at ``max_len`` and such a prompt could not keep a single reply
token (with ``--turns all`` the conversation stops before that turn). ``server``: any
OpenAI-compatible server (vLLM, SGLang, llama.cpp, ...) at ``--url``: ``POST /v1/chat/completions``
with the messages (the server applies its own chat template and context limit), ``--concurrency``
requests in flight, each waiting at most ``--timeout`` seconds, retried ``--retries`` times with
exponential backoff on connection errors, timeouts, 408/409/429 and 5xx (other 4xx answers, such as
"prompt too long", fail at once). ``--server-model`` names the model; by default the first one the
server lists at ``/v1/models``. The server back end imports no torch.

Decoding: greedy by default (``--temperature 0``); ``--temperature T > 0`` samples, with
``--top-p P`` as nucleus mass (no top-k, no repetition penalty, whatever the model's own
generation config says: the data should be the target's distribution at those settings).
``--max-new-tokens`` bounds each reply (default ``workload.max_len``: nothing longer can be trained
on). Flags of the other back end are rejected, not ignored, and so is ``--top-p`` with greedy
decoding: a flag that does nothing would still end up in the sidecar as if it had mattered.

**Output.** One JSON object per line, ``{"id", "conversations": [{"from": "system"|"human"|"gpt",
"value"}], "dflash": {"finish": [...], "new_tokens": [...]}}`` (``finish`` per reply: ``stop`` or
``length``; ``new_tokens`` may hold ``null`` when a server does not report usage; ``stopped:
"context"`` when ``--turns all`` ended a conversation early). :mod:`dflash.data.conversations` parses it (extra keys are
ignored). Text is written with ``ensure_ascii=False`` except for the characters
``str.splitlines`` treats as line breaks (U+0085, U+2028, U+2029), which stay escaped so a reader
that splits lines that way never cuts a record in two.

Beside it: ``DATA.jsonl.meta.json`` (the sidecar: generation settings, target identity with a
cheap weights fingerprint, data set, counts and one entry per run with its speed and timestamps)
and ``DATA.jsonl.failed.jsonl`` (one line per failed prompt and run: id, error, attempts, time).

A record is written once all its turns are answered; a turn that fails fails its record (nothing of
it is written, it is retried by the next run). With ``OPENAI_API_KEY`` set, requests carry it as a
bearer token (for servers started with an API key).

**Resume and safety.** Each record is one ``os.write`` of one whole line on an ``O_APPEND`` file,
followed by ``fsync`` (once per batch of finished records). On start a trailing partial line (a
write torn by a crash) is cut off, the ids already in the file are skipped, and everything else in
the selection is generated, failed prompts included. A file whose sidecar shows other settings
(back end, turns, max-new-tokens, temperature, top-p, the seed when sampling, data set, target
weights or chat template) is never extended: that is a one-line error, before anything is
written. A failed prompt is logged and counted, never fatal. Sampled replies depend on the batch
composition (one random stream per run), so only greedy output is reproducible across resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, TextIO

from dflash.core.atomic import atomic_write_text
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError
from dflash.data.conversations import Conversation, load_conversations, resolve_dataset

FORMAT = "dflash-regenerate/1"
BACKENDS = ("transformers", "server")
TURNS = ("first", "all")
DEFAULT_BATCH_SIZE = 8
DEFAULT_CONCURRENCY = 8
DEFAULT_RETRIES = 3
DEFAULT_TIMEOUT_S = 600.0
BACKOFF_S = 0.5  # first retry waits this long, then doubles, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
PROGRESS_EVERY_S = 2.0
SIDECAR_EVERY_S = 10.0
POOL_BATCHES = 8  # the transformers back end picks each batch among this many batches' worth of prompts
_RETRY_STATUS = frozenset({408, 409, 429})
# json.dumps(ensure_ascii=False) leaves these raw, and str.splitlines() (data.conversations) breaks lines at them.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_SERVER_ONLY = (("server_model", "--server-model"), ("concurrency", "--concurrency"), ("retries", "--retries"),
                ("timeout", "--timeout"), ("url", "--url"))
_LOCAL_ONLY = (("batch_size", "--batch-size"), ("device", "--device"))


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    """The verb's flags, validated, with defaults filled in (None: does not apply to the back end)."""

    out: Path
    backend: str
    turns: str
    limit: int | None
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    url: str | None = None
    server_model: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    retries: int = DEFAULT_RETRIES
    timeout: float = DEFAULT_TIMEOUT_S
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str | None = None

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


def _number(flag: str, v: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(float(v)):
        raise ConfigError(flag, f"must be a number {allowed}", v)
    return float(v)


def _int(flag: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(flag, f"must be an integer >= {lo}", v)
    return v


def server_base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/v1`` (or ``/v1/chat/completions``):
    users paste any of the three forms, the endpoints are appended here."""
    base = url.strip().rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)].rstrip("/")
    return base


def validate_options(args: argparse.Namespace, cfg: DflashConfig) -> Options:
    """Every flag judged before anything is read, loaded or written; raises ConfigError (one line, exit 2)."""
    backend = getattr(args, "backend", None) or "transformers"
    if backend not in BACKENDS:
        raise ConfigError("--backend", f"must be one of {', '.join(BACKENDS)}", backend)
    turns = getattr(args, "turns", None) or "first"
    if turns not in TURNS:
        raise ConfigError("--turns", f"must be one of {', '.join(TURNS)}", turns)
    out_text = getattr(args, "out", None)
    if not out_text or not str(out_text).strip():
        raise ConfigError("--out", "required: the ShareGPT-format JSONL to write or extend", show_got=False)
    out = Path(str(out_text)).expanduser()
    if out.is_dir():
        raise ConfigError("--out", "must be a file path (not a directory)", str(out_text))
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError("--out", "its parent must be a directory", str(out_text))
    for p in (out, sidecar_path(out), failed_path(out)):
        if p.exists() and not p.is_file():
            raise ConfigError("--out", f"{p.name} exists and is not a regular file", str(out_text))

    given = {name: getattr(args, name, None) for name, _ in (*_SERVER_ONLY, *_LOCAL_ONLY)}
    wrong = _SERVER_ONLY if backend == "transformers" else _LOCAL_ONLY
    other = "server" if backend == "transformers" else "transformers"
    for name, flag in wrong:
        if given[name] is not None:
            raise ConfigError(flag, f"only applies to --backend {other}", given[name])

    limit = getattr(args, "limit", None)
    if limit is not None:
        limit = _int("--limit", limit, 1)
    mnt = getattr(args, "max_new_tokens", None)
    max_new = _int("--max-new-tokens", mnt, 1) if mnt is not None else int(cfg.workload.max_len)
    t = getattr(args, "temperature", None)
    temperature = _number("--temperature", t, ">= 0 (0 = greedy)", lambda x: x >= 0) if t is not None else 0.0
    p = getattr(args, "top_p", None)
    if p is not None:
        top_p = _number("--top-p", p, "> 0 and <= 1", lambda x: 0 < x <= 1)
        if temperature == 0:
            raise ConfigError("--top-p", "only applies when sampling: give --temperature > 0 too (greedy ignores it)",
                              p)
    else:
        top_p = 1.0

    opts: dict[str, Any] = {"out": out, "backend": backend, "turns": turns, "limit": limit,
                            "max_new_tokens": max_new, "temperature": temperature, "top_p": top_p,
                            "seed": int(cfg.seed)}
    if backend == "server":
        url = given["url"]
        if url is None:
            raise ConfigError("--url", "required with --backend server: the server's base URL, e.g. "
                              "http://127.0.0.1:8000", show_got=False)
        parts = urllib.parse.urlsplit(str(url).strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ConfigError("--url", "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000",
                              url)
        try:
            parts.port  # noqa: B018 (raises ValueError on a bad port)
        except ValueError:
            raise ConfigError("--url", "has an invalid port", url) from None
        opts["url"] = server_base_url(str(url))
        if given["server_model"] is not None:
            if not str(given["server_model"]).strip():
                raise ConfigError("--server-model", "must not be empty", given["server_model"])
            opts["server_model"] = str(given["server_model"]).strip()
        if given["concurrency"] is not None:
            opts["concurrency"] = _int("--concurrency", given["concurrency"], 1)
        if given["retries"] is not None:
            opts["retries"] = _int("--retries", given["retries"], 0)
        if given["timeout"] is not None:
            opts["timeout"] = _number("--timeout", given["timeout"], "> 0 (seconds)", lambda x: x > 0)
    else:
        if given["batch_size"] is not None:
            opts["batch_size"] = _int("--batch-size", given["batch_size"], 1)
        dev = given["device"] if given["device"] is not None else cfg.target.devices[0]
        opts["device"] = _check_device("--device" if given["device"] is not None else "target.devices", str(dev))
    return Options(**opts)


def _check_device(key: str, dev: str) -> str:
    """A torch device string that exists on this machine (a missing GPU is bad input, not a crash later)."""
    import torch

    try:
        d = torch.device(dev.strip())
    except (RuntimeError, ValueError):
        raise ConfigError(key, "must be a torch device such as cpu, cuda or cuda:1", dev) from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(key, "names a CUDA device but CUDA is not available here", dev)
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(key, f"no such CUDA device ({torch.cuda.device_count()} visible)", dev)
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(key, "names an MPS device but MPS is not available here", dev)
    return str(d)


# --------------------------------------------------------------------------- prompts
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


@dataclass(frozen=True)
class Failure:
    id: str
    error: str
    attempts: int = 1


# --------------------------------------------------------------------------- files
def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def failed_path(out: Path) -> Path:
    return out.with_name(out.name + ".failed.jsonl")


def record_line(record: dict[str, Any]) -> bytes:
    """One record as one line of UTF-8 (no raw character that any line splitter breaks at)."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS.items():
        text = text.replace(ch, esc)
    return (text + "\n").encode("utf-8")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Readers see the old sidecar or the new one, never half of one."""
    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


@dataclass
class Existing:
    """What an earlier run left at ``--out``: ids done, the sidecar, and a torn tail to cut off."""

    done_ids: set[str] = field(default_factory=set)
    records: int = 0
    sidecar: dict[str, Any] | None = None
    keep_bytes: int = 0  # bytes of whole lines
    torn_bytes: int = 0  # bytes of a trailing partial line


def inspect_output(out: Path) -> Existing:
    """Read (never write) the output and its sidecar; a file we did not write is refused (ConfigError)."""
    ex = Existing()
    side = sidecar_path(out)
    if side.is_file():
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError("--out", f"its sidecar {side.name} is unreadable ({exc}); move it away or use "
                              "another --out", str(out)) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("settings"), dict):
            raise ConfigError("--out", f"its sidecar {side.name} was not written by dflash regenerate ({FORMAT})",
                              str(out))
        ex.sidecar = meta
    data = out.read_bytes() if out.is_file() else b""
    if not data:  # nothing generated yet (or the data was deleted): a fresh start, whatever the sidecar said
        ex.sidecar = None
        return ex
    if data and ex.sidecar is None:
        raise ConfigError("--out", f"exists but has no sidecar {side.name}: not a dflash regenerate output, "
                          "refusing to append to it", str(out))
    cut = data.rfind(b"\n") + 1
    ex.keep_bytes, ex.torn_bytes = cut, len(data) - cut
    for n, raw in enumerate(data[:cut].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(
                rec.get("conversations"), list):
            raise ConfigError("--out", f"line {n} is not a dflash regenerate record; refusing to append", str(out))
        ex.done_ids.add(rec["id"])
        ex.records += 1
    return ex


def compare_settings(old: dict[str, Any], new: dict[str, Any], out: Path, keys: Iterable[str] | None = None) -> None:
    """Refuse to extend a file made with other settings: the first difference, on one line."""
    for key in (keys if keys is not None else sorted(set(old) | set(new))):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    raise ConfigError("--out", f"was generated with other settings ({key}.{sub}: {a.get(sub)!r} "
                                      f"there, {b.get(sub)!r} now); use the same settings or another --out", str(out))
        elif a != b:
            raise ConfigError("--out", f"was generated with other settings ({key}: {a!r} there, {b!r} now); "
                              "use the same settings or another --out", str(out))


class Output:
    """Appends whole records to ``--out`` (one write per line, fsync per batch) and failures beside it."""

    def __init__(self, out: Path, existing: Existing) -> None:
        self.path = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if existing.torn_bytes:
            # A line torn by a crash: cut back to the last whole record before appending.
            os.ftruncate(self.fd, existing.keep_bytes)
            os.fsync(self.fd)
        self.failed_fd: int | None = None
        self.written = 0

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        for rec in records:
            _write_all(self.fd, record_line(rec))
        os.fsync(self.fd)
        self.written += len(records)

    def log_failures(self, failures: Sequence[Failure]) -> None:
        if not failures:
            return
        if self.failed_fd is None:
            self.failed_fd = os.open(failed_path(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        t = _now()
        for f in failures:
            _write_all(self.failed_fd, record_line({"id": f.id, "error": f.error, "attempts": f.attempts, "t": t}))
        os.fsync(self.failed_fd)

    def close(self) -> None:
        for fd in (self.fd, self.failed_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.failed_fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# --------------------------------------------------------------------------- progress
class Progress:
    """Counts (thread-safe) and a throttled progress line on stderr: at most one per ``every`` seconds."""

    def __init__(self, total: int, stream: TextIO | None = None, every: float = PROGRESS_EVERY_S) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.replies = 0
        self.tokens = 0
        self.records = 0
        self.failed = 0
        self.skipped = 0
        self.printed: tuple[int, ...] | None = None

    def reply(self, r: Reply) -> None:
        with self.lock:
            self.replies += 1
            self.tokens += r.tokens or 0

    def finished(self, records: int = 0, failed: int = 0, skipped: int = 0) -> None:
        with self.lock:
            self.records += records
            self.failed += failed
            self.skipped += skipped

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rates(self) -> tuple[float, float]:
        """(prompts/s, tokens/s) since generation started; a prompt is one generated reply."""
        dt = max(self.elapsed, 1e-9)
        return self.replies / dt, self.tokens / dt

    def line(self) -> str:
        pps, tps = self.rates()
        handled = self.records + self.failed + self.skipped
        left = self.total - handled
        eta = f", eta {_fmt_s(left * self.elapsed / handled)}" if handled and left > 0 else ""
        return (f"regenerate: {handled}/{self.total} records ({self.records} written, {self.failed} failed, "
                f"{self.skipped} skipped) | {pps:.2f} prompts/s, {tps:.1f} tokens/s{eta}")

    def maybe_print(self, force: bool = False) -> None:
        """The progress line, at most every ``every`` seconds (``force``: now, unless nothing changed)."""
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            state = (self.records, self.failed, self.skipped, self.replies)
            if force and state == self.printed:
                return
            self.printed = state
            print(self.line(), file=self.stream, flush=True)


def _fmt_s(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# --------------------------------------------------------------------------- transformers back end
def weights_fingerprint(model: Any) -> str:
    """A cheap identity of the target's weights: a SHA-256 over every parameter's name, shape and a
    sample of its values rounded to bfloat16 (so the same weights loaded in float32 or bfloat16, on any
    device, give the same hash; hashing the whole multi-GB checkpoint would cost more than it says)."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 2048)
        sample = torch.cat([flat[:2048], flat[::step][:2048]]).to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name}:{tuple(p.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:20]


def chat_template_sha(tokenizer: Any) -> str:
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:16]


class TransformersBackend:
    """Batched ``generate`` on one device: left-padded prompts, an attention mask, greedy or sampled.

    ``max_prompt_tokens``: longer prompts are not generated (:meth:`encode` returns None). Every
    decoding knob is passed explicitly, so a model's own generation config (say ``do_sample=True``,
    ``top_k=20`` or a repetition penalty) cannot change what "greedy" or "temperature T" means here.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, max_prompt_tokens: int | None = None,
                 eos_ids: Iterable[int] | None = None) -> None:
        from dflash.model.acceptance import default_eos_ids

        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_prompt_tokens = max_prompt_tokens
        if eos_ids is None:
            eos_ids = default_eos_ids(_TargetLike(model, tokenizer))
        self.eos_ids = sorted({int(e) for e in eos_ids})
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int] | None:
        """Chat-template token ids with the generation prompt, or None when longer than allowed."""
        from dflash.model.acceptance import render_prompt

        ids = render_prompt(self.tokenizer, list(messages), max_prompt_tokens=10**9).tolist()
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return None
        return ids

    def _gen_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "num_beams": 1, "use_cache": True,
                              "eos_token_id": self.eos_ids or None, "pad_token_id": self.pad_id,
                              "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0, min_p=0.0,
                      typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        else:
            kw.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)  # the library's neutral values
        return kw

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Reply]:
        """Replies to ``prompts`` (token id lists), in order, from one left-padded ``generate`` call."""
        import torch

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        dev = self.device
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **self._gen_kwargs())
        new = out[:, width:].tolist()
        eos = set(self.eos_ids)
        replies = []
        for row in new:
            stop = next((k for k, t in enumerate(row) if t in eos), None)
            toks = row[: stop + 1] if stop is not None else row[: self.max_new_tokens]
            body = toks[:-1] if stop is not None else toks
            text = self.tokenizer.decode(body, skip_special_tokens=True)
            replies.append(Reply(text=text, tokens=len(toks), finish="stop" if stop is not None else "length",
                                 token_ids=tuple(toks)))
        return replies

    def generate_safe(self, prompts: Sequence[Sequence[int]]) -> list[Reply | Failure]:
        """:meth:`generate`, but a failing batch is retried prompt by prompt, so one bad prompt (too long
        for memory, say) fails alone instead of taking its batch with it."""
        try:
            return list(self.generate(prompts))
        except Exception as exc:  # (any failure of generate is a failed prompt, not a crash)
            if len(prompts) == 1:
                return [Failure("", _err(exc))]
            first = exc
        _free_accelerator_memory()
        out: list[Reply | Failure] = []
        for p in prompts:
            try:
                out.append(self.generate([p])[0])
            except Exception as exc:  # the batch error is kept in the message
                out.append(Failure("", f"{_err(exc)} (batch: {_err(first)})", attempts=2))
        return out


@dataclass(frozen=True)
class _TargetLike:
    model: Any
    tokenizer: Any


def _free_accelerator_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _err(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


def run_transformers(jobs: Iterable[Job], backend: TransformersBackend, batch_size: int,
                     emit: Callable[[list[dict[str, Any]], list[Failure]], None], progress: Progress,
                     window: int = POOL_BATCHES) -> None:
    """Length-grouped continuous batching over records.

    A pool holds up to ``window * batch_size`` prompts ready to go (new records in data order, and
    records of ``--turns all`` waiting for their next turn); each batch is the ``batch_size`` shortest
    of them (ties: earlier record first). Why: a left-padded batch costs its longest prompt times its
    rows, and ShareGPT's prompts range from 30 to thousands of tokens, so batching neighbours in data
    order spends most of the prefill on padding. Long prompts still go once they fill the pool or the
    data runs out. Finished records are emitted right after the batch that finished them.
    """
    pending: Iterator[Job] = iter(jobs)
    pool: list[tuple[int, Job, list[int]]] = []  # (data order, job, prompt ids of its next turn)
    order = 0
    exhausted = False
    while True:
        records: list[dict[str, Any]] = []
        failures: list[Failure] = []
        while len(pool) < batch_size * window and not exhausted:
            job = next(pending, None)
            if job is None:
                exhausted = True
                break
            ids = backend.encode(job.next_messages())
            if ids is None:
                progress.finished(skipped=1)
                continue
            pool.append((order, job, ids))
            order += 1
        if not pool:
            break
        pool.sort(key=lambda e: (len(e[2]), e[0]))
        batch, pool = pool[:batch_size], pool[batch_size:]
        results = backend.generate_safe([ids for _, _, ids in batch])
        for (k, job, _), res in zip(batch, results, strict=True):
            if isinstance(res, Failure):
                failures.append(Failure(job.source.id, res.error, res.attempts))
                continue
            progress.reply(res)
            job.advance(res)
            if not job.done:
                nxt = backend.encode(job.next_messages())
                if nxt is None:
                    job.stop("context")  # the next turn's prompt would not fit workload.max_len
                else:
                    pool.append((k, job, nxt))
                    continue
            records.append(job.record())
        emit(records, failures)
        progress.finished(records=len(records), failed=len(failures))
        progress.maybe_print()


# --------------------------------------------------------------------------- server back end
class RequestFailed(Exception):
    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class _Retryable(Exception):
    def __init__(self, message: str, wait_s: float | None = None) -> None:
        super().__init__(message)
        self.wait_s = wait_s


class ServerClient:
    """A minimal OpenAI-compatible chat client on the standard library (urllib): nothing to install,
    and the server process stays the user's own (vLLM, SGLang, llama.cpp, TGI ...)."""

    def __init__(self, base_url: str, *, model: str | None, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, backoff_s: float = BACKOFF_S) -> None:
        self.base = server_base_url(base_url)
        self.model = model
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        key = os.environ.get("OPENAI_API_KEY")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = _http_detail(exc)
            if exc.code in _RETRY_STATUS or exc.code >= 500:
                retry_after = exc.headers.get("Retry-After") if exc.headers else None
                wait_s = float(retry_after) if retry_after and retry_after.strip().isdigit() else None
                raise _Retryable(f"HTTP {exc.code}: {detail}", wait_s) from None
            raise RequestFailed(f"HTTP {exc.code}: {detail}", 1) from None
        except TimeoutError:
            raise _Retryable(f"timed out after {self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise _Retryable(f"timed out after {self.timeout:g} s") from None
            raise _Retryable(f"cannot connect: {reason}") from None
        except (HTTPException, ConnectionError, OSError) as exc:
            raise _Retryable(_err(exc)) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise _Retryable(f"not JSON: {raw[:120]!r}") from None

    def _with_retries(self, fn: Callable[[], Any]) -> Any:
        last = "no attempt"
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except RequestFailed as exc:
                raise RequestFailed(str(exc), attempt + 1) from None
            except _Retryable as exc:
                last = str(exc)
                if attempt < self.retries:
                    base = min(BACKOFF_MAX_S, self.backoff_s * 2 ** attempt)
                    time.sleep(exc.wait_s if exc.wait_s is not None else base * (0.75 + 0.5 * random.random()))
        raise RequestFailed(last, self.retries + 1)

    def list_models(self) -> list[str]:
        """Model ids the server serves (``GET /v1/models``)."""
        got = self._with_retries(lambda: self._request("GET", "/v1/models"))
        data = got.get("data") if isinstance(got, dict) else None
        if not isinstance(data, list):
            raise RequestFailed(f"/v1/models answered without a data list: {str(got)[:120]}", 1)
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]

    def body(self, messages: Sequence[dict[str, str]]) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "messages": list(messages), "max_tokens": self.max_new_tokens,
                             "temperature": self.temperature, "stream": False}
        if self.temperature > 0:
            b["top_p"] = self.top_p
            b["seed"] = self.seed
        return b

    def chat(self, messages: Sequence[dict[str, str]]) -> Reply:
        """One reply, retried as the module docstring says; raises RequestFailed."""
        body = self.body(messages)

        def once() -> Reply:
            got = self._request("POST", "/v1/chat/completions", body)
            try:
                choice = got["choices"][0]
                text = choice["message"]["content"]
                if not isinstance(text, str):
                    raise TypeError("message.content is not a string")
            except (KeyError, IndexError, TypeError) as exc:
                raise _Retryable(f"malformed completion ({_err(exc)}): {str(got)[:160]}") from None
            usage = got.get("usage") if isinstance(got.get("usage"), dict) else {}
            tokens = usage.get("completion_tokens")
            finish = choice.get("finish_reason") or "stop"
            return Reply(text=text, tokens=int(tokens) if isinstance(tokens, int) else None, finish=str(finish))

        return self._with_retries(once)


def _http_detail(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read().decode("utf-8", "replace")
    except Exception:  # (the body is only decoration for the error line)
        text = ""
    return " ".join((text or str(exc.reason)).split())[:300]


def run_server(jobs: Iterable[Job], client: ServerClient, concurrency: int,
               emit: Callable[[list[dict[str, Any]], list[Failure]], None], progress: Progress) -> None:
    """``concurrency`` records in flight on a thread pool (a record's turns go one after another); the
    main thread alone writes, batching whatever finished since the last wake-up into one fsync."""

    def work(job: Job) -> Job:
        while not job.done:
            reply = client.chat(job.next_messages())
            progress.reply(reply)
            job.advance(reply)
        return job

    pending = iter(jobs)
    inflight: dict[Future[Job], Job] = {}
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate")
    try:
        while True:
            while len(inflight) < concurrency:
                job = next(pending, None)
                if job is None:
                    break
                inflight[pool.submit(work, job)] = job
            if not inflight:
                break
            done, _ = wait(list(inflight), timeout=PROGRESS_EVERY_S, return_when=FIRST_COMPLETED)
            records: list[dict[str, Any]] = []
            failures: list[Failure] = []
            for fut in done:
                job = inflight.pop(fut)
                try:
                    records.append(fut.result().record())
                except RequestFailed as exc:
                    failures.append(Failure(job.source.id, str(exc), exc.attempts))
                except Exception as exc:  # (a bug in one reply must not lose the others)
                    failures.append(Failure(job.source.id, _err(exc)))
            emit(records, failures)
            progress.finished(records=len(records), failed=len(failures))
            progress.maybe_print()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the verb
def dataset_identity(path: Path, name: str) -> dict[str, Any]:
    return {"name": name if name == "sharegpt" else path.name, "bytes": path.stat().st_size}


def _settings(opts: Options, dataset: dict[str, Any]) -> dict[str, Any]:
    """What the records depend on (compared before extending a file); the target joins after loading."""
    return {"backend": opts.backend, "turns": opts.turns, "max_new_tokens": opts.max_new_tokens,
            "temperature": opts.temperature, "top_p": opts.top_p,
            "seed": opts.seed if opts.sampling else None, "dataset": dataset}


class _Session:
    """The sidecar of this run: rewritten atomically at the start, every few seconds and at the end."""

    def __init__(self, opts: Options, settings: dict[str, Any], target: dict[str, Any],
                 existing: Existing, selection: dict[str, Any]) -> None:
        self.opts = opts
        self.path = sidecar_path(opts.out)
        old = existing.sidecar or {}
        self.created = old.get("created", _now())
        self.runs: list[dict[str, Any]] = list(old.get("runs", []))
        self.settings = settings
        self.target = target
        self.base_records = existing.records
        self.selection = selection
        keys = ("limit", "url", "concurrency", "retries", "timeout") if opts.backend == "server" else (
            "limit", "batch_size", "device")
        run_opts = {k: getattr(opts, k) for k in keys}
        self.run: dict[str, Any] = {"started": _now(), "ended": None, "status": "running", **run_opts}
        self.runs.append(self.run)
        self.last = 0.0

    def write(self, progress: Progress, status: str | None = None, force: bool = True) -> None:
        now = time.perf_counter()
        if not force and now - self.last < SIDECAR_EVERY_S:
            return
        self.last = now
        pps, tps = progress.rates()
        if status is not None:
            self.run["status"] = status
            self.run["ended"] = _now()
        self.run.update(records_written=progress.records, failed=progress.failed, skipped=progress.skipped,
                        prompts=progress.replies, new_tokens=progress.tokens,
                        generate_s=round(progress.elapsed, 3), prompts_per_s=round(pps, 4),
                        tokens_per_s=round(tps, 2))
        meta = {"format": FORMAT, "settings": self.settings, "target": self.target,
                "counts": {"records": self.base_records + progress.records, "failed_last_run": progress.failed,
                           "skipped_last_run": progress.skipped, **self.selection},
                "created": self.created, "updated": _now(), "runs": self.runs}
        _write_json_atomic(self.path, meta)


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """``dflash regenerate``: validate, read prompts, check the existing output, generate, summarise."""
    opts = validate_options(args, cfg)

    data_path = resolve_dataset(cfg.workload.dataset)
    convs, stats = load_conversations(data_path, "conversation", cfg.workload.max_conversations)
    sources, ineligible = prompt_sources(convs, opts.turns)
    if not sources:
        raise ConfigError("workload.dataset", "has no record that opens with a user turn (nothing to regenerate)",
                          cfg.workload.dataset)
    selected = sources[: opts.limit] if opts.limit is not None else sources
    settings = _settings(opts, dataset_identity(data_path, cfg.workload.dataset))

    existing = inspect_output(opts.out)
    if existing.sidecar is not None:
        compare_settings(existing.sidecar["settings"], settings, opts.out, keys=list(settings))

    todo = [s for s in selected if s.id not in existing.done_ids]
    selection = {"dataset_records": stats.records, "eligible": len(sources), "ineligible": ineligible + stats.skipped,
                 "broken": stats.broken, "selected": len(selected)}

    # The back end: the only slow step before writing, and the last place a bad input can surface.
    backend: TransformersBackend | None = None
    client: ServerClient | None = None
    if opts.backend == "transformers":
        if todo:
            backend, target = _load_local(opts, cfg)
        else:
            target = dict((existing.sidecar or {}).get("target", {}))
    else:
        client, target = _connect(opts)
    settings = {**settings, "target": {k: target[k] for k in _TARGET_KEYS[opts.backend] if k in target}}
    if existing.sidecar is not None and "target" in existing.sidecar["settings"]:
        compare_settings(existing.sidecar["settings"], settings, opts.out, keys=["target"])

    session = _Session(opts, settings, target, existing, selection)
    output = Output(opts.out, existing)
    if existing.torn_bytes:
        print(f"regenerate: cut a partial last line ({existing.torn_bytes} bytes) off {opts.out}", file=sys.stderr)
    print(f"regenerate: {len(selected)} records selected ({len(selected) - len(todo)} already in {opts.out}, "
          f"{len(todo)} to do; {len(sources)} eligible of {stats.records} in {cfg.workload.dataset}); "
          f"backend {opts.backend}, turns {opts.turns}, max_new_tokens {opts.max_new_tokens}, "
          f"{'greedy' if not opts.sampling else f'temperature {opts.temperature:g}, top_p {opts.top_p:g}'}",
          file=sys.stderr, flush=True)
    progress = Progress(len(todo))

    def emit(records: list[dict[str, Any]], failures: list[Failure]) -> None:
        output.write(records)
        output.log_failures(failures)
        session.write(progress, force=False)

    status = "finished"
    session.write(progress)
    try:
        jobs = (Job(s) for s in todo)
        if backend is not None:
            if opts.sampling:
                import torch

                torch.manual_seed(opts.seed)
            run_transformers(jobs, backend, opts.batch_size, emit, progress)
        elif client is not None:
            run_server(jobs, client, opts.concurrency, emit, progress)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        output.close()
        session.write(progress, status=status if sys.exc_info()[0] in (None, KeyboardInterrupt) else "crashed")
        progress.maybe_print(force=True)

    pps, tps = progress.rates()
    total = existing.records + progress.records
    print(f"regenerated {progress.records} records ({progress.replies} replies, {progress.tokens} new tokens) in "
          f"{progress.elapsed:.1f} s: {pps:.3f} prompts/s, {tps:.1f} tokens/s; {progress.failed} failed"
          f"{f' (see {failed_path(opts.out)})' if progress.failed else ''}, {progress.skipped} skipped "
          f"(prompt over workload.max_len); {opts.out} holds {total} records")
    print(f"train on it: [workload] dataset = \"{opts.out}\"; settings in {sidecar_path(opts.out)}")
    if status == "interrupted":
        print("interrupted: run the same command again to finish (done records are skipped)", file=sys.stderr)
        return 130
    return 0


_TARGET_KEYS = {"transformers": ("weights_sha", "chat_template_sha"), "server": ("server_model",)}


def _load_local(opts: Options, cfg: DflashConfig) -> tuple[TransformersBackend, dict[str, Any]]:
    import torch

    from dflash.model.target import load_target

    dtype = torch.bfloat16 if str(opts.device).startswith("cuda") else torch.float32
    print(f"regenerate: loading target {cfg.target.model} on {opts.device} ({str(dtype).removeprefix('torch.')})",
          file=sys.stderr, flush=True)
    lt = load_target(cfg.target.model, device=opts.device, dtype=dtype)
    backend = TransformersBackend(lt.model, lt.tokenizer, max_new_tokens=opts.max_new_tokens,
                                  temperature=opts.temperature, top_p=opts.top_p,
                                  max_prompt_tokens=int(cfg.workload.max_len) - 1)
    target = {"model": cfg.target.model, "source": lt.source, "weights_sha": weights_fingerprint(lt.model),
              "chat_template_sha": chat_template_sha(lt.tokenizer),
              "architecture": type(lt.model).__name__, "dtype": str(dtype).removeprefix("torch."),
              "device": opts.device, "eos_ids": backend.eos_ids,
              "max_prompt_tokens": backend.max_prompt_tokens}
    return backend, target


def _connect(opts: Options) -> tuple[ServerClient, dict[str, Any]]:
    assert opts.url is not None
    client = ServerClient(opts.url, model=opts.server_model, max_new_tokens=opts.max_new_tokens,
                          temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, timeout=opts.timeout,
                          retries=min(opts.retries, 1))
    try:
        models = client.list_models()
    except RequestFailed as exc:
        if opts.server_model is None or "HTTP" not in str(exc):
            raise ConfigError("--url", f"no OpenAI-compatible server answered at {opts.url}/v1/models ({exc})",
                              show_got=False) from None
        models = []  # the server answers but lists no models: trust --server-model
    if opts.server_model is None:
        if not models:
            raise ConfigError("--server-model", f"the server at {opts.url} lists no model; name one", show_got=False)
        client.model = models[0]
    elif models and opts.server_model not in models:
        raise ConfigError("--server-model", f"the server serves {', '.join(models[:5])}", opts.server_model)
    client.retries = opts.retries
    return client, {"server_model": client.model, "url": opts.url, "served_models": models[:20]}


__all__ = [
    "FORMAT", "Failure", "Job", "Options", "Output", "Progress", "Reply", "RequestFailed", "ServerClient", "Source",
    "TransformersBackend", "compare_settings", "failed_path", "handle", "inspect_output", "prompt_sources",
    "record_line", "run_server", "run_transformers", "server_base_url", "sidecar_path", "validate_options",
    "weights_fingerprint",
]
