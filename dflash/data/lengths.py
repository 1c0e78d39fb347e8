"""Token lengths of a data set under the target's tokenizer and chat template, cached on disk.

The simulator and the sweep only need each conversation's token count. Computing it needs the
tokenizer (transformers); reading it back must not: :func:`cached_lengths` looks the lengths up by
a key built from file metadata alone, and imports transformers only on a cache miss.

Cached lengths are *untruncated*, so one file serves every ``max_len``: :meth:`LengthTable.clipped`
is the view for one. The key hashes the data set's identity (resolved path, size, mtime), the
tokenizer's identity (model string and its file identity, tokenizer class, vocab size, chat
template), the sample shape and ``max_conversations``. The tokenizer's class and vocab size are
learned the first time a model is loaded and kept in a small per-model file, so later look-ups need
no tokenizer. All writes are atomic (temporary file, then ``os.replace``).

Cache directory: :func:`dflash.data.cache_dir.default_cache_dir` (``$DFLASH_CACHE_DIR``, else
``$XDG_CACHE_HOME/dflash`` or ``~/.cache/dflash``)::

    tokenizers/<name>-<hash>/     a converted tokenizer (dflash.data.model_source, ~8 s for the packaged GGUF)
    tokenizer_ids/<hash>.json     model identity -> tokenizer class, vocab size, template hash
    lengths/<stem>-<sample>-<key>.json

This module is torch-free at import time. Finding the model and loading its tokenizer is
:mod:`dflash.data.model_source`'s job (``load_tokenizer`` is read from there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.atomic import atomic_write_text
from dflash.core.config import WorkloadConfig
from dflash.core.errors import ConfigError
from dflash.data.cache_dir import default_cache_dir
from dflash.data.cache_entry import exclusive
from dflash.data.conversations import Conversation, ParseStats, load_conversations, resolve_dataset, say_damaged
from dflash.data.model_source import file_id, load_tokenizer, model_identity

LENGTHS_FORMAT = 3  # bump when rendering or counting changes: old cache files stop matching


# --------------------------------------------------------------------------- identities
def _hash(obj: Any, n: int = 20) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def tokenizer_identity(tokenizer: Any, model: str) -> dict[str, Any]:
    template = getattr(tokenizer, "chat_template", None)
    return {
        "model": model,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "chat_template_sha": hashlib.sha256(str(template).encode()).hexdigest()[:16],
    }


def _messages(conv: Conversation | Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    pairs = conv.messages if isinstance(conv, Conversation) else conv
    return [{"role": r, "content": c} for r, c in pairs]


def conversation_token_lengths(convs: Iterable[Conversation], tokenizer: Any, *, batch_size: int = 256,
                               progress: bool = False) -> list[int]:
    """Full (untruncated) token count of each conversation under the tokenizer's chat template.

    Equal to ``len(apply_chat_template(messages, tokenize=True)["input_ids"])``: the template is
    rendered to text in batches and the text encoded without extra special tokens (which is what
    ``apply_chat_template`` does), through the Rust backend's parallel batch encoder when there is
    one.
    """
    convs = list(convs)
    encode = _fast_encoder(tokenizer)

    bar = None
    if progress and convs:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(convs), desc="tokenising", unit="conv", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    out: list[int] = []
    try:
        for start in range(0, len(convs), batch_size):
            chunk = [_messages(c) for c in convs[start:start + batch_size]]
            texts = tokenizer.apply_chat_template(chunk, tokenize=False)
            if isinstance(texts, str):
                texts = [texts]
            if encode is not None:
                out.extend(len(e.ids) for e in encode(list(texts), add_special_tokens=False))
            else:
                ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
                out.extend(len(x) for x in ids)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return out


def prompt_token_lengths(convs: Iterable[Conversation], tokenizer: Any, *, batch_size: int = 256) -> list[int]:
    """Tokens before the first response token of each conversation that can hold an anchor: the turns
    before its first non-empty response rendered with the assistant header (``add_generation_prompt``).
    An empty response is skipped because its one response token (the end-of-turn token) holds no
    anchor (:func:`dflash.core.sampler.has_anchor` needs two consecutive response tokens).

    The drafter trains only on positions inside responses, so how many anchors a truncated sequence
    offers depends on where its first response starts; the simulator uses this to give each
    sequence the anchor count the trainer will find (for multi-turn conversations it counts every
    token after the first prompt as response, an upper bound). A conversation without a non-empty
    response gets its full length.
    """
    out: list[int] = []
    convs = list(convs)
    encode = _fast_encoder(tokenizer)
    for start in range(0, len(convs), batch_size):
        prompts = []
        for conv in convs[start:start + batch_size]:
            msgs = _messages(conv)
            first = next((k for k, m in enumerate(msgs) if m["role"] == "assistant" and m["content"]), None)
            prompts.append(msgs[:first] if first is not None else msgs)
        # A conversation that opens with a response has no prompt: its responses start at once.
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) if m else ""
                 for m in prompts]
        if encode is not None:  # the Rust batch encoder without offsets: the same ids, a cold demo's seconds
            out.extend(len(e.ids) for e in encode(texts, add_special_tokens=False))
        else:
            out.extend(len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return out


def _fast_encoder(tokenizer: Any) -> Any:
    """The backend's parallel batch encoder (``encode_batch_fast``, else ``encode_batch``), or None when
    the tokenizer has none or settings (truncation, padding) that would change the counts."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)


# --------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class LengthTable:
    """Untruncated token lengths of a data set's conversations, in file order."""

    ids: tuple[str, ...]
    lengths: tuple[int, ...]
    key: str
    source: Mapping[str, Any] = field(default_factory=dict)
    stats: ParseStats = field(default_factory=ParseStats)
    prompt_lengths: tuple[int, ...] = ()  # tokens before the first response token; empty when unknown

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.lengths):
            raise ValueError(f"{len(self.ids)} ids but {len(self.lengths)} lengths")
        if self.prompt_lengths and len(self.prompt_lengths) != len(self.lengths):
            raise ValueError(f"{len(self.prompt_lengths)} prompt lengths but {len(self.lengths)} lengths")

    def __len__(self) -> int:
        return len(self.lengths)

    def clipped(self, max_len: int) -> list[int]:
        """Lengths as the target sees them with truncation at ``max_len``."""
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ConfigError("workload.max_len", "must be an integer >= 1", max_len)
        return [min(n, max_len) for n in self.lengths]

    lengths_for = clipped

    def to_json(self) -> dict[str, Any]:
        return {"format": LENGTHS_FORMAT, "key": self.key, "source": dict(self.source),
                "stats": asdict(self.stats), "ids": list(self.ids), "lengths": list(self.lengths),
                "prompt_lengths": list(self.prompt_lengths)}


class LengthCache:
    """The on-disk cache: per-model tokenizer identities and length tables (module docstring)."""

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    # tokenizer identities ------------------------------------------------------------
    def _tid_path(self, mid: Mapping[str, Any]) -> Path:
        return self.dir / "tokenizer_ids" / f"{_hash(mid)}.json"

    def tokenizer_identity(self, mid: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            data = json.loads(self._tid_path(mid).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("model_identity") != json.loads(json.dumps(mid)):
            return None
        tid = data.get("tokenizer")
        return tid if isinstance(tid, dict) else None

    def put_tokenizer_identity(self, mid: Mapping[str, Any], tid: Mapping[str, Any]) -> None:
        atomic_write_text(self._tid_path(mid),
                           json.dumps({"model_identity": mid, "tokenizer": tid}, sort_keys=True))

    # length tables -------------------------------------------------------------------
    @staticmethod
    def key(data_path: Path, tid: Mapping[str, Any], sample: str, max_conversations: int | None) -> str:
        return _hash({"format": LENGTHS_FORMAT, "dataset": file_id(data_path), "tokenizer": dict(tid),
                      "sample": sample, "max_conversations": max_conversations})

    def path(self, key: str, data_path: Path | None = None, sample: str | None = None) -> Path:
        stem = f"{data_path.stem[:40]}-{sample}-" if data_path is not None and sample else ""
        return self.dir / "lengths" / f"{stem}{key}.json"

    def load(self, key: str, data_path: Path | None = None, sample: str | None = None) -> LengthTable | None:
        """The table stored under ``key``, or None (missing or unreadable: recompute)."""
        try:
            data = json.loads(self.path(key, data_path, sample).read_text(encoding="utf-8"))
            if data.get("format") != LENGTHS_FORMAT or data.get("key") != key:
                return None
            return LengthTable(ids=tuple(str(i) for i in data["ids"]),
                               lengths=tuple(int(n) for n in data["lengths"]),
                               key=key, source=data.get("source", {}),
                               stats=ParseStats(**data.get("stats", {})),
                               prompt_lengths=tuple(int(n) for n in data.get("prompt_lengths", ())))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def save(self, table: LengthTable, data_path: Path | None = None, sample: str | None = None) -> Path:
        p = self.path(table.key, data_path, sample)
        atomic_write_text(p, json.dumps(table.to_json(), separators=(",", ":")))
        return p


def cached_lengths(workload: WorkloadConfig, model: str = "smollm2", cache_dir: str | Path | None = None,
                   progress: bool = True) -> LengthTable:
    """Untruncated lengths of ``workload``'s conversations, from the cache or computed once.

    A hit reads one JSON file and imports neither torch nor transformers. A miss parses the data
    set, loads the tokenizer, tokenises every kept conversation and stores the table.
    """
    data_path = resolve_dataset(workload.dataset, model)
    sample, max_conv = workload.sample, workload.max_conversations
    cache = LengthCache(cache_dir)
    mid = model_identity(model)

    tok = None
    tid = cache.tokenizer_identity(mid)
    if tid is None:
        tok = load_tokenizer(model, cache.dir)
        tid = tokenizer_identity(tok, model)
        cache.put_tokenizer_identity(mid, tid)
    key = cache.key(data_path, tid, sample, max_conv)
    table = cache.load(key, data_path, sample)
    if table is not None:
        return table

    with exclusive(cache.path(key, data_path, sample)):  # ranks starting together tokenise once
        table = cache.load(key, data_path, sample)  # computed by another process while we waited
        if table is not None:
            return table
        return _tokenise_and_store(workload, model, mid, cache, data_path, tid, tok, progress)


def _tokenise_and_store(workload: WorkloadConfig, model: str, mid: Mapping[str, Any], cache: LengthCache,
                        data_path: Path, tid: Mapping[str, Any], tok: Any, progress: bool) -> LengthTable:
    sample, max_conv = workload.sample, workload.max_conversations
    key = cache.key(data_path, tid, sample, max_conv)
    convs, stats = load_conversations(data_path, sample, max_conv)  # none usable: a one-line ConfigError
    say_damaged(data_path, stats)
    if tok is None:
        tok = load_tokenizer(model, cache.dir)
        fresh = tokenizer_identity(tok, model)
        if fresh != tid:  # the stored identity was stale (e.g. a hub model changed)
            tid = fresh
            cache.put_tokenizer_identity(mid, tid)
            key = cache.key(data_path, tid, sample, max_conv)
            table = cache.load(key, data_path, sample)
            if table is not None:
                return table
    if progress:
        print(f"dflash: tokenising {len(convs)} conversations of {data_path.name} with {model} "
              f"(once; cached in {cache.dir})", file=sys.stderr)
    t0 = time.perf_counter()
    lengths = conversation_token_lengths(convs, tok, progress=progress)
    prompts = prompt_token_lengths(convs, tok)
    st = data_path.stat()
    source = {"dataset": str(data_path), "dataset_size": st.st_size, "dataset_mtime_ns": st.st_mtime_ns,
              "sample": sample, "max_conversations": max_conv, "tokenizer": tid,
              "tokenise_s": round(time.perf_counter() - t0, 3),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    table = LengthTable(ids=tuple(c.id for c in convs), lengths=tuple(lengths), key=key, source=source,
                        stats=stats, prompt_lengths=tuple(min(p, n) for p, n in zip(prompts, lengths, strict=True)))
    with contextlib.suppress(OSError):  # a read-only cache still gives the caller its lengths
        cache.save(table, data_path, sample)
    return table


def load_lengths_file(path: str | Path) -> LengthTable:
    """A user's lengths file: a JSON list of positive integers, or ``{"lengths": [...]}`` with an
    optional ``"ids"`` list of the same size. Lengths are taken as untruncated."""
    p = Path(path).expanduser()
    want = 'must be a JSON list of positive integers or {"lengths": [...], "ids": [...]}'
    try:
        raw = p.read_bytes()
        data = json.loads(raw)
    except OSError as exc:
        raise ConfigError("lengths file", f"cannot read: {exc.strerror or exc}", str(path)) from None
    except ValueError:
        raise ConfigError("lengths file", f"{want}; it is not valid JSON", str(path)) from None
    ids: list[Any] | None = None
    if isinstance(data, dict):
        ids = data.get("ids")
        data = data.get("lengths")
    if (not isinstance(data, list) or not data
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in data)):
        raise ConfigError("lengths file", want, str(path))
    if ids is None:
        ids = [f"#{k}" for k in range(len(data))]
    elif not isinstance(ids, list) or len(ids) != len(data):
        raise ConfigError("lengths file", "'ids' must be a list as long as 'lengths'", str(path))
    key = hashlib.sha256(raw).hexdigest()[:20]
    return LengthTable(ids=tuple(str(i) for i in ids), lengths=tuple(data), key=key,
                       source={"lengths_file": str(p.resolve())},
                       stats=ParseStats(records=len(data), kept=len(data)))
