"""The server back end: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI, ...) through the
``openai`` client library, the convention for such servers.

Why the library: retries with exponential backoff and jitter (connection errors, timeouts, 408,
409, 429 and 5xx, honouring ``Retry-After``; other 4xx such as "prompt too long" fail at once),
per-request timeouts and an async client are built in, so nothing here re-implements them.
``POST /v1/chat/completions`` carries the messages (the server applies its own chat template and
context limit); ``--concurrency`` records are in flight on one event loop, a record's turns one
after another; each request waits at most ``--timeout`` seconds and is retried ``--retries``
times. ``--server-model`` names the model, by default the first one ``/v1/models`` lists. With
``OPENAI_API_KEY`` set, requests carry it as the bearer token (else the placeholder ``EMPTY``,
vLLM's convention for servers without a key). ``openai`` is an extra (``dflash-tune[server]``),
imported only inside :func:`~dflash.regenerate.options.require_openai`; the back end imports no torch.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.errors import ConfigError
from dflash.regenerate.options import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, Options, require_openai
from dflash.regenerate.progress import PROGRESS_EVERY_S, Progress
from dflash.regenerate.prompts import Job, Reply
from dflash.regenerate.writer import Emit, Failure, error_text

NO_KEY = "EMPTY"  # sent when OPENAI_API_KEY is unset: the client needs some key, keyless servers ignore it


class RequestFailed(Exception):
    """A request that got no usable answer after its retries; ``status`` when the server answered."""

    def __init__(self, message: str, attempts: int, status: int | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status = status


def _client_kwargs(base_url: str, timeout: float, retries: int) -> dict[str, Any]:
    return {"base_url": base_url + "/v1", "api_key": os.environ.get("OPENAI_API_KEY") or NO_KEY,
            "timeout": timeout, "max_retries": retries}


def _failed(exc: Exception, timeout: float, retries: int) -> RequestFailed:
    """The library's error as one line for the failed-prompt log, with the attempts it made."""
    openai = require_openai()
    attempts = _attempts(exc, retries)
    if isinstance(exc, openai.APIStatusError):
        detail = " ".join((exc.response.text or exc.message).split())[:300]
        return RequestFailed(f"HTTP {exc.status_code}: {detail}", attempts, exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return RequestFailed(f"timed out after {timeout:g} s", attempts)
    if isinstance(exc, openai.APIConnectionError):
        return RequestFailed(f"cannot connect: {error_text(exc.__cause__ or exc)}", attempts)
    return RequestFailed(error_text(exc), attempts)


def _attempts(exc: Exception, retries: int) -> int:
    """Requests made: the last one's ``x-stainless-retry-count`` header + 1. Clients too old to send it
    retried everything but a 4xx other than 408/409/429 ``retries`` times."""
    request = getattr(exc, "request", None)
    count = request.headers.get("x-stainless-retry-count") if request is not None else None
    if count is not None and count.isdigit():
        return int(count) + 1
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status < 500 and status not in (408, 409, 429):
        return 1
    return retries + 1 if request is not None else 1


def list_models(base_url: str, timeout: float, retries: int) -> list[str]:
    """Model ids the server serves (``GET /v1/models``); raises RequestFailed."""
    openai = require_openai()
    with openai.OpenAI(**_client_kwargs(base_url, timeout, retries)) as api:
        try:
            page = api.models.list()
        except openai.OpenAIError as exc:
            raise _failed(exc, timeout, retries) from None
    data = getattr(page, "data", None)
    if not isinstance(data, list):
        raise RequestFailed(f"/v1/models answered without a data list: {str(page)[:120]}", 1)
    return [str(m.id) for m in data if getattr(m, "id", None) is not None]


@dataclass(frozen=True)
class ServerClient:
    """What every chat request carries; :meth:`chat` sends one on an ``openai.AsyncOpenAI`` client."""

    base_url: str
    model: str
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    timeout: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES

    def open(self) -> Any:
        """An async client bound to the running event loop (close it with ``await client.close()``)."""
        return require_openai().AsyncOpenAI(**_client_kwargs(self.base_url, self.timeout, self.retries))

    def request(self, messages: Sequence[dict[str, str]]) -> dict[str, Any]:
        """The keyword arguments of ``chat.completions.create``: greedy sends no top_p and no seed."""
        r: dict[str, Any] = {"model": self.model, "messages": list(messages), "max_tokens": self.max_new_tokens,
                             "temperature": self.temperature, "stream": False}
        if self.temperature > 0:
            r.update(top_p=self.top_p, seed=self.seed)
        return r

    async def chat(self, api: Any, messages: Sequence[dict[str, str]]) -> Reply:
        """One reply, retried by the library as the module docstring says; raises RequestFailed."""
        try:
            got = await api.chat.completions.create(**self.request(messages))
        except Exception as exc:  # the library's errors, and whatever a broken answer raised in it
            raise _failed(exc, self.timeout, self.retries) from None
        return _reply(got)


def _reply(got: Any) -> Reply:
    """The first choice of a completion; a completion without text fails its record (no retry: a
    server that answers 200 with no text would answer the same again)."""
    try:
        choice = got.choices[0]
        text = choice.message.content
    except (AttributeError, IndexError, TypeError) as exc:
        raise RequestFailed(f"malformed completion ({error_text(exc)}): {str(got)[:160]}", 1) from None
    if not isinstance(text, str):
        raise RequestFailed(f"malformed completion (message.content is not a string): {str(got)[:160]}", 1)
    tokens = getattr(getattr(got, "usage", None), "completion_tokens", None)
    return Reply(text=text, tokens=tokens if isinstance(tokens, int) else None,
                 finish=str(getattr(choice, "finish_reason", None) or "stop"))


# --------------------------------------------------------------------------- the verb's server run
def connect(opts: Options) -> tuple[ServerClient, dict[str, Any]]:
    """The model to ask (``--server-model`` or the server's first) and the target identity for the sidecar.
    An unreachable server is bad input (ConfigError), found before anything is written."""
    assert opts.url is not None
    try:
        models = list_models(opts.url, opts.timeout, min(opts.retries, 1))
    except RequestFailed as exc:
        if opts.server_model is None or exc.status is None:
            raise ConfigError("--url", f"no OpenAI-compatible server answered at {opts.url}/v1/models ({exc})",
                              show_got=False) from None
        models = []  # the server answers but lists no models: trust --server-model
    if opts.server_model is None and not models:
        raise ConfigError("--server-model", f"the server at {opts.url} lists no model; name one", show_got=False)
    if opts.server_model is not None and models and opts.server_model not in models:
        raise ConfigError("--server-model", f"the server serves {', '.join(models[:5])}", opts.server_model)
    model = opts.server_model or models[0]
    client = ServerClient(opts.url, model=model, max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                          top_p=opts.top_p, seed=opts.seed, timeout=opts.timeout, retries=opts.retries)
    return client, {"server_model": model, "url": opts.url, "served_models": models[:20]}


def run_server(jobs: Iterable[Job], client: ServerClient, concurrency: int, emit: Emit, progress: Progress) -> None:
    """``concurrency`` records in flight on one event loop; whatever finished since the last wake-up
    (at least every 2 s) is written with one fsync. Ctrl-C cancels what is in flight."""
    asyncio.run(_serve(iter(jobs), client, concurrency, emit, progress))


async def _serve(pending: Iterator[Job], client: ServerClient, concurrency: int, emit: Emit,
                 progress: Progress) -> None:
    api = client.open()
    inflight: dict[asyncio.Task[Job], Job] = {}
    try:
        while _top_up(inflight, pending, concurrency, lambda job: _answer(client, api, job, progress)):
            done, _ = await asyncio.wait(inflight, timeout=PROGRESS_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
            records, failures = _collect(done, inflight)
            emit(records, failures)
            progress.finished(records=len(records), failed=len(failures))
            progress.maybe_print()
    finally:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        await api.close()


def _top_up(inflight: dict[asyncio.Task[Job], Job], pending: Iterator[Job], concurrency: int, answer: Any) -> bool:
    """Start records until ``concurrency`` are in flight; False when nothing is left at all."""
    while len(inflight) < concurrency and (job := next(pending, None)) is not None:
        inflight[asyncio.create_task(answer(job))] = job
    return bool(inflight)


async def _answer(client: ServerClient, api: Any, job: Job, progress: Progress) -> Job:
    while not job.done:
        reply = await client.chat(api, job.next_messages())
        progress.reply(reply)
        job.advance(reply)
    return job


def _collect(done: set[asyncio.Task[Job]], inflight: dict[asyncio.Task[Job], Job]) -> tuple[list[dict[str, Any]],
                                                                                            list[Failure]]:
    records: list[dict[str, Any]] = []
    failures: list[Failure] = []
    for task in done:
        job = inflight.pop(task)
        try:
            records.append(task.result().record())
        except RequestFailed as exc:
            failures.append(Failure(job.source.id, str(exc), exc.attempts))
        except Exception as exc:  # (a bug in one reply must not lose the others)
            failures.append(Failure(job.source.id, error_text(exc)))
    return records, failures
