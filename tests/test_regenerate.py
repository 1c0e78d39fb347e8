"""``dflash regenerate``: the target's own replies, batched and resumable, locally or from a server.

A tiny random Llama with SmolLM2's real tokenizer and chat template stands in for the target. Exact
comparisons use float64 (no near-tie in the logits can flip between a padded batch and a lone
prompt); the CLI runs load the saved float32 model and are compared with the same back-end code on
the same batches. The server back end talks to a real HTTP server on loopback that serves the tiny
model's greedy replies and injects failures, slow answers and refusals.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from dflash.cli import main
from dflash.data.conversations import load_conversations
from dflash.model.acceptance import greedy_generate, render_prompt
from dflash.regenerate import (
    Job,
    Progress,
    TransformersBackend,
    failed_path,
    prompt_sources,
    record_line,
    run_transformers,
    sidecar_path,
)
from tests.conftest import left_in_session, sigint_default
from tests.tiny_models import tiny_llama

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 24
MAX_LEN = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok():
    from dflash.data.model_source import load_tokenizer

    return load_tokenizer("smollm2")


def user(text: str) -> dict[str, str]:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict[str, str]:
    return {"from": "gpt", "value": text}


def question(i: int) -> str:
    return f"Question {i}: " + "why " * (2 * i)


def dataset_records() -> list[dict]:
    recs = [{"id": f"c{i}", "conversations": [user(question(i)), gpt("orig"), user(f"and then {i}?"), gpt("x")]}
            for i in range(10)]
    recs.insert(3, {"id": "gpt-first", "conversations": [gpt("continued"), user("more"), gpt("y")]})
    recs.append({"id": "sys", "conversations": [{"from": "system", "value": "Be brief."}, user("Hi"), gpt("Hello")]})
    recs.append({"id": "c3", "conversations": [user("a second record with id c3"), gpt("z")]})
    recs.append({"id": "long", "conversations": [user("word " * 400), gpt("ok")]})
    recs.append({"id": "sep", "conversations": [user("line\u2028sep\x85nel \U0001f600 done"), gpt("ok")]})
    recs.append({"id": "empty", "conversations": [user("   "), gpt("ok")]})
    return recs


def write_config(path: Path, dataset: Path, model_dir: Path | None = None) -> Path:
    text = f'[workload]\ndataset = "{dataset}"\nmax_len = {MAX_LEN}\nbucket_bounds = [128, {MAX_LEN}]\n'
    if model_dir is not None:
        text += f'[target]\nmodel = "{model_dir}"\n'
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, tok):
    """The float64 tiny target, its float32 twin saved as a model directory (with a second EOS id that
    greedy decoding actually meets, so batches mix finished and unfinished rows), and a data set."""
    root = tmp_path_factory.mktemp("regen")
    m64 = tiny_llama(seed=0, dtype=torch.float64, vocab_size=len(tok), init_std=0.3)
    first = greedy_generate(m64, render_prompt(tok, [{"role": "user", "content": question(0)}], 10**9), MAX_NEW, {2})
    extra_eos = first[4]
    m32 = tiny_llama(seed=0, dtype=torch.float32, vocab_size=len(tok), init_std=0.3)
    m32.generation_config.eos_token_id = [2, extra_eos]
    model_dir = root / "tiny"
    m32.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in dataset_records()) + "\n", encoding="utf-8")
    return {"root": root, "m64": m64, "eos": [2, extra_eos], "model_dir": model_dir, "data": data,
            "config": write_config(root / "cfg.toml", data, model_dir)}


def read_records(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.split(b"\n")[:-1]]


def tree(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- prompts
def test_prompt_sources_first_and_all_turns(world):
    from dflash.data.conversations import load_conversations

    convs, _ = load_conversations(world["data"], "conversation")
    first, bad = prompt_sources(convs, "first")
    ids = [s.id for s in first]
    assert ids == [*(f"c{i}" for i in range(10)), "sys", "c3#dup2", "long", "sep"]
    assert bad == 2  # opens with an assistant turn; empty first user turn
    assert first[0].user_turns == (question(0),) and first[10].system == ("Be brief.",)
    every, _ = prompt_sources(convs, "all")
    assert every[1].user_turns == (question(1), "and then 1?")
    job = Job(every[1])
    assert job.next_messages() == [{"role": "user", "content": question(1)}]


# --------------------------------------------------------------------------- the local back end
def test_batched_replies_equal_the_models_own_greedy_output(world, tok):
    """Left-padded batches of different prompt lengths give token for token what a plain, unbatched
    greedy decode gives, including rows that stop at an EOS while others run to the bound."""
    m64, eos = world["m64"], world["eos"]
    backend = TransformersBackend(m64, tok, max_new_tokens=MAX_NEW, eos_ids=eos)
    prompts = [backend.encode([{"role": "user", "content": question(i)}]) for i in range(7)]
    assert len({len(p) for p in prompts}) == 7  # every batch is padded
    refs = [greedy_generate(m64, p, MAX_NEW, set(eos)) for p in prompts]
    for batch in ([0, 1, 2, 3, 4, 5, 6], [6, 0, 3], [2]):
        replies = backend.generate([prompts[i] for i in batch])
        for i, r in zip(batch, replies, strict=True):
            assert list(r.token_ids) == refs[i], i
            assert r.tokens == len(refs[i])
            assert r.finish == ("stop" if refs[i][-1] in eos else "length")
            body = refs[i][:-1] if r.finish == "stop" else refs[i]
            assert r.text == tok.decode(body, skip_special_tokens=True)
    finishes = Counter(("stop" if r[-1] in eos else "length") for r in refs)
    assert finishes["stop"] >= 1 and finishes["length"] >= 1, finishes
    assert backend.encode([{"role": "user", "content": "word " * 400}]) is not None
    short = TransformersBackend(m64, tok, max_new_tokens=MAX_NEW, eos_ids=eos, max_prompt_tokens=MAX_LEN - 1)
    assert short.encode([{"role": "user", "content": "word " * 400}]) is None


def test_every_turn_is_asked_with_the_regenerated_context(world, tok):
    """``--turns all`` on the local back end: each user turn goes to the model after the replies it gave
    before (the original assistant turns never appear), records of several lengths share batches, and
    a conversation whose next prompt would not fit stops there and says so."""
    m64, eos = world["m64"], world["eos"]
    convs, _ = load_conversations(world["data"], "conversation")
    sources = [s for s in prompt_sources(convs, "all")[0] if s.id != "long"]
    backend = TransformersBackend(m64, tok, max_new_tokens=MAX_NEW, eos_ids=eos, max_prompt_tokens=90)
    got: list[dict] = []

    def emit(records: list[dict], failures: list) -> None:
        assert not failures
        got.extend(records)

    progress = Progress(len(sources), stream=io.StringIO())
    run_transformers((Job(s) for s in sources), backend, 4, emit, progress)
    assert sorted(r["id"] for r in got) == sorted(s.id for s in sources)
    stopped = 0
    for rec in got:
        src = next(s for s in sources if s.id == rec["id"])
        context = [{"role": "system", "content": c} for c in src.system]
        want = [{"from": "system", "value": c} for c in src.system]
        for u in src.user_turns:
            msgs = [*context, {"role": "user", "content": u}]
            if len(render_prompt(tok, msgs, 10**9)) > 90:
                assert rec["dflash"]["stopped"] == "context"
                stopped += 1
                break
            ref = greedy_generate(m64, render_prompt(tok, msgs, 10**9), MAX_NEW, set(eos))
            text = tok.decode(ref[:-1] if ref[-1] in eos else ref, skip_special_tokens=True)
            context += [{"role": "user", "content": u}, {"role": "assistant", "content": text}]
            want += [user(u), gpt(text)]
        assert rec["conversations"] == want, rec["id"]
    assert 0 < stopped < len(got)
    assert progress.records == len(got) and progress.replies == sum(len(r["dflash"]["finish"]) for r in got)


def test_sampling_follows_the_seed(world, tok):
    m64 = world["m64"]
    backend = TransformersBackend(m64, tok, max_new_tokens=12, temperature=0.9, top_p=0.9, eos_ids=[2])
    prompts = [backend.encode([{"role": "user", "content": question(i)}]) for i in range(3)]
    torch.manual_seed(5)
    a = [r.token_ids for r in backend.generate(prompts)]
    torch.manual_seed(5)
    b = [r.token_ids for r in backend.generate(prompts)]
    assert a == b
    greedy = [tuple(greedy_generate(m64, p, 12, {2})) for p in prompts]
    assert a != greedy and all(len(x) <= 12 for x in a)


def test_cli_writes_sharegpt_that_dflash_reads(world, tok, tmp_path, capsys):
    """End to end on the saved model: records are the back end's replies on the same batches (data
    order, too-long prompts skipped), data.py reads the file back, and a rerun is a no-op."""
    from dflash.model.target import load_target

    out = tmp_path / "regen" / "data.jsonl"
    argv = ["regenerate", "--config", str(world["config"]), "--out", str(out), "--max-new-tokens", str(MAX_NEW),
            "--batch-size", "3"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "prompts/s" in captured.err and "tokens/s" in captured.err
    assert "holds 13 records" in captured.out

    recs = read_records(out)
    expected_ids = [*(f"c{i}" for i in range(10)), "sys", "c3#dup2", "sep"]  # "long" is over max_len

    lt = load_target(str(world["model_dir"]))
    backend = TransformersBackend(lt.model, lt.tokenizer, max_new_tokens=MAX_NEW)
    assert backend.eos_ids == world["eos"]
    convs, _ = load_conversations(world["data"], "conversation")
    sources = {s.id: s for s in prompt_sources(convs, "first")[0]}
    prompts = [backend.encode(Job(sources[i]).next_messages()) for i in expected_ids]
    # all 13 fit in the pool: batches of 3 of the shortest first (ties in data order), written in that order
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    assert order != list(range(len(prompts)))
    want = {}
    for k in range(0, len(order), 3):
        chunk = order[k:k + 3]
        for i, reply in zip(chunk, backend.generate([prompts[i] for i in chunk]), strict=True):
            want[expected_ids[i]] = reply
    assert [r["id"] for r in recs] == [expected_ids[i] for i in order]
    for rec in recs:
        src, reply = sources[rec["id"]], want[rec["id"]]
        conv = rec["conversations"]
        assert conv[-2] == {"from": "human", "value": src.user_turns[0]}
        assert conv[-1] == {"from": "gpt", "value": reply.text}
        assert rec["dflash"] == {"finish": [reply.finish], "new_tokens": [reply.tokens]}
    assert {"stop", "length"} <= {f for r in recs for f in r["dflash"]["finish"]}  # the extra EOS stops some
    by_id = {r["id"]: r for r in recs}
    assert by_id["sys"]["conversations"][0] == {"from": "system", "value": "Be brief."}
    assert b"\xe2\x80\xa8" not in out.read_bytes() and "\U0001f600".encode() in out.read_bytes()

    # dflash train reads it like any data set, the line-separator record included
    got, stats = load_conversations(out, "conversation")
    assert stats.broken == 0 and sorted(c.id for c in got) == sorted(expected_ids)
    sep = next(c for c in got if c.id == "sep")
    assert sep.messages[0] == ("user", "line\u2028sep\x85nel \U0001f600 done")
    fe, _ = load_conversations(out, "first_exchange")
    assert len(fe) == 12  # the record with a system turn does not open with a user turn

    meta = json.loads(sidecar_path(out).read_text())
    assert meta["settings"]["max_new_tokens"] == MAX_NEW and meta["settings"]["temperature"] == 0.0
    assert meta["settings"]["target"]["weights_sha"] == meta["target"]["weights_sha"]
    assert meta["counts"]["records"] == 13 and meta["runs"][-1]["skipped"] == 1
    assert meta["runs"][-1]["status"] == "finished" and meta["runs"][-1]["tokens_per_s"] > 0

    before = out.read_bytes()
    assert main(argv) == 0  # everything done: nothing generated, nothing appended
    assert out.read_bytes() == before
    assert "(0 written, 0 failed, 1 skipped)" in capsys.readouterr().err  # the long prompt is checked again

    # other settings never extend the file: one line, exit 2, file untouched
    assert main([*argv[:-4], "--max-new-tokens", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_new_tokens: 24 there, 7 now" in err, err
    assert out.read_bytes() == before


# --------------------------------------------------------------------------- kill and resume
def test_resume_after_sigkill_has_no_duplicate_and_no_gap(world, tmp_path, capsys):
    from dflash.model.target import load_target

    n = 40
    data = tmp_path / "many.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"q{i}", "conversations": [user(question(i % 9) + str(i)),
                                                                             gpt("o")]}) for i in range(n)))
    cfg = write_config(tmp_path / "c.toml", data, world["model_dir"])
    out = tmp_path / "out.jsonl"
    argv = ["regenerate", "--config", str(cfg), "--out", str(out), "--max-new-tokens", str(MAX_NEW),
            "--batch-size", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *argv], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and out.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    first = read_records(out)
    assert 3 <= len(first) < n
    with open(out, "ab") as f:  # and a write torn by the crash
        f.write(b'{"id":"q39","conversations":[{"from":"hu')

    assert main(argv) == 0
    assert "cut a partial last line" in capsys.readouterr().err
    recs = read_records(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == n and set(ids) == {f"q{i}" for i in range(n)}
    assert recs[: len(first)] == first

    lt = load_target(str(world["model_dir"]))
    backend = TransformersBackend(lt.model, lt.tokenizer, max_new_tokens=MAX_NEW)
    for rec in recs:
        i = int(rec["id"][1:])
        reply = backend.generate([backend.encode([{"role": "user", "content": question(i % 9) + str(i)}])])[0]
        assert rec["conversations"][1]["value"] == reply.text, rec["id"]
    meta = json.loads(sidecar_path(out).read_text())
    assert [r["status"] for r in meta["runs"]] == ["running", "finished"]  # the killed run never finished
    assert meta["counts"]["records"] == n


# --------------------------------------------------------------------------- the server back end
class StubServer:
    """An OpenAI-compatible chat server on loopback that answers with the tiny model's greedy reply.

    Markers in the last user message: ``always-500`` (server error every time), ``bad-400`` (a
    refusal, not retried), ``once-503`` (an error, then fine), ``slow-once`` (answers the first request
    after 1.2 s, past the client's timeout, then promptly), ``hold`` (answers after 0.3 s), ``sleepy``
    (after 20 s). It records each request's Authorization header and the most requests in flight at once.
    """

    def __init__(self, model, tok, eos) -> None:
        self.model, self.tok, self.eos = model, tok, set(eos)
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.first_turns: list[str] = []
        self.auth: list[str | None] = []
        self.inflight = self.max_inflight = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout): nothing to do
                    pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.send(200, {"object": "list", "data": [{"id": "tiny-stub", "object": "model"}]})
                else:
                    self.send(404, {"error": "not found"})

            def do_POST(self) -> None:
                with stub.lock:
                    stub.auth.append(self.headers.get("Authorization"))
                    stub.inflight += 1
                    stub.max_inflight = max(stub.max_inflight, stub.inflight)
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    code, obj, delay = stub.answer(self.path, body)
                    time.sleep(delay)
                finally:  # before the answer goes out: the client may send its next request right after it
                    with stub.lock:
                        stub.inflight -= 1
                self.send(code, obj)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, messages: list[dict], max_tokens: int) -> tuple[str, str, int]:
        ids = render_prompt(self.tok, messages, 10**9)
        with self.lock:
            toks = greedy_generate(self.model, ids, max_tokens, self.eos)
        stop = toks[-1] in self.eos
        return self.tok.decode(toks[:-1] if stop else toks, skip_special_tokens=True), \
            ("stop" if stop else "length"), len(toks)

    def answer(self, path: str, body: dict) -> tuple[int, dict, float]:
        if path != "/v1/chat/completions" or body.get("model") != "tiny-stub":
            return 404, {"error": "unknown route or model"}, 0.0
        msgs = body["messages"]
        last = msgs[-1]["content"]
        with self.lock:
            self.calls[last] += 1
            n = self.calls[last]
            self.first_turns.append(next(m["content"] for m in msgs if m["role"] == "user"))
        if "always-500" in last:
            return 500, {"error": "boom"}, 0.0
        if "bad-400" in last:
            return 400, {"error": {"message": "prompt too long"}}, 0.0
        if "once-503" in last and n == 1:
            return 503, {"error": "busy"}, 0.0
        delay = 1.2 if "slow-once" in last and n == 1 else 0.3 if "hold" in last else 20.0 if "sleepy" in last else 0.0
        text, finish, ntok = self.reply(msgs, body["max_tokens"])
        return 200, {"id": "x", "object": "chat.completion", "model": "tiny-stub",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish}],
                     "usage": {"prompt_tokens": 0, "completion_tokens": ntok, "total_tokens": ntok}}, delay

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub(world, tok):
    s = StubServer(world["m64"], tok, world["eos"])
    yield s
    s.close()


def test_server_backend_retries_times_out_and_counts_failures(world, stub, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    turns = {"s0": ["Tell me about cats.", "And dogs?"], "s1": ["once-503 please", "again"],
             "s2": ["first", "slow-once second"], "s3": ["always-500", "never asked"],
             "s4": ["bad-400", "never"], "s5": ["Short one.", "Longer follow-up " * 5]}
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"id": k, "conversations": [x for u in v for x in (user(u), gpt("o"))]})
                              for k, v in turns.items()))
    cfg = write_config(tmp_path / "c.toml", data)
    out = tmp_path / "srv.jsonl"
    argv = ["regenerate", "--config", str(cfg), "--out", str(out), "--backend", "server", "--url", stub.url + "/v1",
            "--turns", "all", "--max-new-tokens", "16", "--concurrency", "3", "--retries", "2", "--timeout", "0.5"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "2 failed" in cap.out

    recs = {r["id"]: r for r in read_records(out)}
    assert sorted(recs) == ["s0", "s1", "s2", "s5"]
    for rid, rec in recs.items():  # each turn asked with the regenerated context before it
        context: list[dict] = []
        want = []
        for u in turns[rid]:
            text, _, _ = stub.reply([*context, {"role": "user", "content": u}], 16)
            context += [{"role": "user", "content": u}, {"role": "assistant", "content": text}]
            want += [user(u), gpt(text)]
        assert rec["conversations"] == want, rid
        assert len(rec["dflash"]["new_tokens"]) == 2 and all(t > 0 for t in rec["dflash"]["new_tokens"])
    assert stub.calls["once-503 please"] == 2 and stub.calls["slow-once second"] == 2
    assert stub.calls["always-500"] == 3 and stub.calls["bad-400"] == 1 and stub.calls["never asked"] == 0

    failed = read_records(failed_path(out))
    by_id = {f["id"]: f for f in failed}
    assert sorted(by_id) == ["s3", "s4"]
    assert by_id["s3"]["attempts"] == 3 and "HTTP 500" in by_id["s3"]["error"]
    assert by_id["s4"]["attempts"] == 1 and "prompt too long" in by_id["s4"]["error"]
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["settings"]["target"] == {"server_model": "tiny-stub"} and meta["settings"]["backend"] == "server"
    assert meta["counts"]["records"] == 4 and meta["counts"]["failed_last_run"] == 2

    # a rerun asks only for what is not done yet: the two failures, which fail again
    stub.first_turns.clear()
    before = out.read_bytes()
    assert main(argv) == 0
    assert set(stub.first_turns) == {"always-500", "bad-400"}
    assert out.read_bytes() == before and len(read_records(failed_path(out))) == 4
    assert set(stub.auth) == {"Bearer EMPTY"}  # no key set: the placeholder keyless servers ignore


def chat_data(path: Path, questions: dict[str, str]) -> Path:
    path.write_text("\n".join(json.dumps({"id": k, "conversations": [user(q), gpt("o")]})
                              for k, q in questions.items()))
    return path


def test_server_sends_the_key_and_keeps_concurrency_records_in_flight(stub, tmp_path, capsys, monkeypatch):
    """Eight slow answers with --concurrency 3: never more than three requests at the server, and three
    at once (the async client does not serialise them); OPENAI_API_KEY goes out as the bearer token."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-local-test")
    data = chat_data(tmp_path / "d.jsonl", {f"h{i}": f"hold {i}" for i in range(8)})
    out = tmp_path / "o.jsonl"
    assert main(["regenerate", "--config", str(write_config(tmp_path / "c.toml", data)), "--out", str(out),
                 "--backend", "server", "--url", stub.url, "--server-model", "tiny-stub", "--concurrency", "3",
                 "--max-new-tokens", "4"]) == 0
    assert "holds 8 records" in capsys.readouterr().out
    assert sorted(r["id"] for r in read_records(out)) == [f"h{i}" for i in range(8)]
    assert stub.max_inflight == 3
    assert stub.auth == ["Bearer sk-local-test"] * 8


def test_server_model_must_be_one_the_server_serves(stub, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.toml", chat_data(tmp_path / "d.jsonl", {"a": "hello"}))
    out = tmp_path / "o.jsonl"
    before = tree(tmp_path)
    assert main(["regenerate", "--config", str(cfg), "--out", str(out),
                 "--backend", "server", "--url", stub.url + "/v1/chat/completions", "--server-model", "other"]) == 2
    err = capsys.readouterr().err
    assert err == "dflash regenerate: error: --server-model: the server serves tiny-stub (got 'other')\n"
    assert tree(tmp_path) == before and stub.auth == []


def test_ctrl_c_on_the_server_backend_keeps_whole_records(stub, tmp_path):
    """SIGINT while requests hang: the async requests are cancelled, exit 130, the finished records
    whole and the run marked interrupted in the sidecar."""
    questions = {"a": "quick one", "b": "quick two", "c": "sleepy three", "d": "sleepy four"}
    data = chat_data(tmp_path / "d.jsonl", questions)
    out = tmp_path / "o.jsonl"
    argv = ["regenerate", "--config", str(write_config(tmp_path / "c.toml", data)), "--out", str(out),
            "--backend", "server", "--url", stub.url, "--concurrency", "2", "--max-new-tokens", "4"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and stub.calls["sleepy four"] == 0:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: run the same command again" in err and "Traceback" not in err
    assert sorted(r["id"] for r in read_records(out)) == ["a", "b"]
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["runs"][-1]["status"] == "interrupted" and meta["counts"]["records"] == 2


def test_sigterm_keeps_whole_records_and_a_rerun_does_the_rest_each_once(stub, tmp_path):
    """SIGTERM (a cluster's stop, issue #38) while a request is in flight: exit 143, the one line, no
    traceback, the finished records whole and the sidecar marked interrupted; the same command again
    asks the server only what was left, once each (the stub counts every question)."""
    questions = {"a": "quick one", "b": "quick two", "c": "slow-once three", "d": "quick four"}
    data = chat_data(tmp_path / "d.jsonl", questions)
    out = tmp_path / "o.jsonl"
    argv = ["regenerate", "--config", str(write_config(tmp_path / "c.toml", data)), "--out", str(out),
            "--backend", "server", "--url", stub.url, "--concurrency", "1", "--max-new-tokens", "4"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60  # the third request hangs 1.2 s: the signal comes while it is in flight
        while time.monotonic() < deadline and proc.poll() is None and stub.calls["slow-once three"] == 0:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "dflash regenerate: terminated" and "Traceback" not in err, err
    assert not left_in_session(proc.pid, 10)
    first = [r["id"] for r in read_records(out)]
    assert first == ["a", "b"]
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["runs"][-1]["status"] == "interrupted" and meta["counts"]["records"] == 2
    asked = dict(stub.calls)

    assert main(argv) == 0
    assert sorted(r["id"] for r in read_records(out)) == ["a", "b", "c", "d"]  # no gap, no duplicate
    meta = json.loads(sidecar_path(out).read_text())
    assert [r["status"] for r in meta["runs"]] == ["interrupted", "finished"] and meta["counts"]["records"] == 4
    again = {q: stub.calls[q] - asked.get(q, 0) for q in questions.values()}
    assert again == {"quick one": 0, "quick two": 0, "slow-once three": 1, "quick four": 1}, again


def test_server_backend_without_openai_names_the_extra(tmp_path):
    """A base install has no openai: one line naming the extra, exit 2, nothing written."""
    probe = ("import importlib.abc, sys\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] == 'openai': raise ImportError(name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "from dflash.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    got = subprocess.run([sys.executable, "-c", probe, "regenerate", "--out", str(tmp_path / "o.jsonl"),
                          "--backend", "server", "--url", "http://127.0.0.1:9"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr == ("dflash regenerate: error: --backend: server needs the openai client library: "
                          "pip install 'dflash-tune[server]'\n")
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- bad input
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = [
    (["--temperature", "-0.5"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p"),
    (["--top-p", "0.9"], "--top-p"),  # greedy ignores it
    (["--backend", "server"], "--url"),
    (["--backend", "server", "--url", "ftp://example.org"], "--url"),
    (["--backend", "server", "--url", "localhost:8000"], "--url"),
    (["--backend", "server", "--url", "http://127.0.0.1:8000", "--batch-size", "4"], "--batch-size"),
    (["--backend", "server", "--url", "http://127.0.0.1:8000", "--device", "cpu"], "--device"),
    (["--url", "http://127.0.0.1:8000"], "--url"),
    (["--concurrency", "4"], "--concurrency"),
    (["--retries", "1"], "--retries"),
    (["--timeout", "5"], "--timeout"),
    (["--server-model", "m"], "--server-model"),
    (["--device", "not-a-device"], "--device"),
    (["--limit", "0"], "--limit"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD)
def test_bad_input_is_one_line_exit_2(extra, flag, tmp_path, capsys):
    before = tree(tmp_path)
    assert main(["regenerate", "--out", str(tmp_path / "o.jsonl"), *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("dflash regenerate: error: ") and err.count("\n") == 1, err
    assert flag in err, err
    assert tree(tmp_path) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_device_is_bad_input(tmp_path, capsys):
    assert main(["regenerate", "--out", str(tmp_path / "o.jsonl"), "--device", "cuda:0"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_foreign_file_and_unreachable_server_are_refused(world, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.toml", world["data"], world["model_dir"])
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"hello": 1}\n')
    before = tree(tmp_path)
    assert main(["regenerate", "--config", str(cfg), "--out", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no sidecar" in err, err
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["regenerate", "--config", str(cfg), "--out", str(tmp_path / "s.jsonl"), "--backend", "server",
                 "--url", url, "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no OpenAI-compatible server answered" in err, err
    assert tree(tmp_path) == before


def test_record_lines_survive_any_line_splitter():
    rec = {"id": "x", "conversations": [user("a\u2028b\u2029c\x85d\ne")]}
    line = record_line(rec)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    text = line.decode()
    assert len(text.splitlines()) == 1 and json.loads(text) == rec
