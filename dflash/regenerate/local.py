"""The transformers back end: the target runs batched, left-padded ``generate`` on one device.

Why batches of the shortest prompts: a left-padded batch costs its longest prompt times its rows,
and ShareGPT's prompts range from 30 to thousands of tokens, so each batch is the ``--batch-size``
shortest prompts of a pool of eight batches' worth (:func:`run_transformers`), and a ``--turns all``
record rejoins the pool with its next turn. Prompts are rendered with the target's chat template
and the generation prompt (:func:`dflash.model.acceptance.render_prompt`, never shortened); a prompt
of ``workload.max_len`` tokens or more is skipped and counted, because the trainer truncates every
sequence at ``max_len`` and such a prompt could not keep a single reply token (with ``--turns all``
the conversation stops before that turn). The target loads in float32 on the CPU, bfloat16 on CUDA.
Torch is imported inside the functions, so the CLI's import stays torch-free.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.config import DflashConfig
from dflash.regenerate.options import Options
from dflash.regenerate.progress import Progress
from dflash.regenerate.prompts import Job, Reply
from dflash.regenerate.writer import Emit, Failure, error_text

POOL_BATCHES = 8  # each batch is picked among this many batches' worth of prompts


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
        self._eos = frozenset(self.eos_ids)
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
        ids, mask = self._left_padded(prompts)
        dev = self.device
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **self._gen_kwargs())
        return [self._reply(row) for row in out[:, ids.shape[1]:].tolist()]

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids, mask

    def _reply(self, row: list[int]) -> Reply:
        """One generated row up to and including its first EOS (the text leaves the EOS out)."""
        stop = next((k for k, t in enumerate(row) if t in self._eos), None)
        toks = row[: stop + 1] if stop is not None else row[: self.max_new_tokens]
        body = toks[:-1] if stop is not None else toks
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        return Reply(text=text, tokens=len(toks), finish="stop" if stop is not None else "length",
                     token_ids=tuple(toks))

    def generate_safe(self, prompts: Sequence[Sequence[int]]) -> list[Reply | Failure]:
        """:meth:`generate`, but a failing batch is retried prompt by prompt, so one bad prompt (too long
        for memory, say) fails alone instead of taking its batch with it."""
        try:
            return list(self.generate(prompts))
        except Exception as exc:  # (any failure of generate is a failed prompt, not a crash)
            if len(prompts) == 1:
                return [Failure("", error_text(exc))]
            first = exc
        _free_accelerator_memory()
        out: list[Reply | Failure] = []
        for p in prompts:
            try:
                out.append(self.generate([p])[0])
            except Exception as exc:  # the batch error is kept in the message
                out.append(Failure("", f"{error_text(exc)} (batch: {error_text(first)})", attempts=2))
        return out


@dataclass(frozen=True)
class _TargetLike:
    model: Any
    tokenizer: Any


def _free_accelerator_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()



# --------------------------------------------------------------------------- length-grouped batching
def run_transformers(jobs: Iterable[Job], backend: TransformersBackend, batch_size: int, emit: Emit,
                     progress: Progress, window: int = POOL_BATCHES) -> None:
    """Length-grouped continuous batching over records.

    A pool holds up to ``window * batch_size`` prompts ready to go (new records in data order, and
    records of ``--turns all`` waiting for their next turn); each batch is the ``batch_size`` shortest
    of them (ties: earlier record first). Long prompts still go once they fill the pool or the data
    runs out. Finished records are emitted right after the batch that finished them.
    """
    pool = _Pool(iter(jobs), backend, progress, batch_size * window)
    while (batch := pool.next_batch(batch_size)):
        results = backend.generate_safe([ids for _, _, ids in batch])
        records: list[dict[str, Any]] = []
        failures: list[Failure] = []
        for (order, job, _), res in zip(batch, results, strict=True):
            if isinstance(res, Failure):
                failures.append(Failure(job.source.id, res.error, res.attempts))
            elif _advance(job, res, progress, pool, order):
                records.append(job.record())
        emit(records, failures)
        progress.finished(records=len(records), failed=len(failures))
        progress.maybe_print()


class _Pool:
    """Prompts ready to go: (data order, job, prompt ids of its next turn), refilled from ``jobs``."""

    def __init__(self, jobs: Iterator[Job], backend: TransformersBackend, progress: Progress, size: int) -> None:
        self.jobs, self.backend, self.progress, self.size = jobs, backend, progress, size
        self.entries: list[tuple[int, Job, list[int]]] = []
        self.order = 0
        self.exhausted = False

    def add(self, order: int, job: Job, ids: list[int]) -> None:
        self.entries.append((order, job, ids))

    def _fill(self) -> None:
        while len(self.entries) < self.size and not self.exhausted:
            job = next(self.jobs, None)
            if job is None:
                self.exhausted = True
            elif (ids := self.backend.encode(job.next_messages())) is None:
                self.progress.finished(skipped=1)  # over workload.max_len: not one reply token would survive
            else:
                self.add(self.order, job, ids)
                self.order += 1

    def next_batch(self, batch_size: int) -> list[tuple[int, Job, list[int]]]:
        """The ``batch_size`` shortest prompts of the refilled pool (empty: all done)."""
        self._fill()
        self.entries.sort(key=lambda e: (len(e[2]), e[0]))
        batch, self.entries = self.entries[:batch_size], self.entries[batch_size:]
        return batch


def _advance(job: Job, reply: Reply, progress: Progress, pool: _Pool, order: int) -> bool:
    """Take the reply; True when the record is finished, else its next turn is back in the pool."""
    progress.reply(reply)
    job.advance(reply)
    if job.done:
        return True
    nxt = pool.backend.encode(job.next_messages())
    if nxt is None:
        job.stop("context")  # the next turn's prompt would not fit workload.max_len
        return True
    pool.add(order, job, nxt)
    return False


# --------------------------------------------------------------------------- the verb's local run
def load_local(opts: Options, cfg: DflashConfig) -> tuple[TransformersBackend, dict[str, Any]]:
    """The target on ``--device`` and its identity for the sidecar (weights and chat template hashes)."""
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


def local_generator(opts: Options, backend: TransformersBackend) -> Callable[[Iterable[Job], Emit, Progress], None]:
    """The run's generation step: one random stream per run, seeded from the config when sampling."""

    def generate(jobs: Iterable[Job], emit: Emit, progress: Progress) -> None:
        if opts.sampling:
            import torch

            torch.manual_seed(opts.seed)
        run_transformers(jobs, backend, opts.batch_size, emit, progress)

    return generate
