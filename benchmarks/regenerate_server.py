"""Client overhead of `dflash regenerate --backend server`: the openai-client back end (dflash.regenerate.server)
against the hand-written urllib one it replaced (commit 9f88991), side by side in one run, on the same loopback
OpenAI-compatible stub that answers every chat request at once with a fixed 32-token reply.

    python benchmarks/regenerate_server.py --old /tmp/old_regen.py   # (git show 9f88991:dflash/regenerate/__init__.py)

Prints requests/s per back end and concurrency (best of --repeat)."""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import io
import json
import sys
import threading
import time

from dflash.regenerate import Job, Progress, ServerClient, Source, run_server

REPLY = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "created": 0,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 32},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 8, "completion_tokens": 32, "total_tokens": 40}}).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM and SGLang answer
    wbufsize = 1 << 16  # headers and body in one segment (two small writes meet the peer's delayed ACK: 40 ms)

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(REPLY)))
        self.end_headers()
        self.wfile.write(REPLY)


def jobs(n: int) -> list[Job]:
    return [Job(Source(f"q{i}", (), (f"question {i}",))) for i in range(n)]


def timed(run, n: int) -> float:
    progress = Progress(n, stream=io.StringIO())
    done: list = []
    t0 = time.perf_counter()
    run(jobs(n), lambda records, failures: done.extend(records + failures), progress)
    dt = time.perf_counter() - t0
    assert len(done) == n and progress.failed == 0, progress.line()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("old_regen", a.old)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_regen"] = old
    spec.loader.exec_module(old)
    http.server.ThreadingHTTPServer.request_queue_size = 256  # the default backlog of 5 refuses 32 new connections
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    new_client = ServerClient(url, model="m", max_new_tokens=32, timeout=30, retries=0)
    old_client = old.ServerClient(url, model="m", max_new_tokens=32, timeout=30, retries=0)
    print("concurrency  urllib threads (old) req/s  openai async (new) req/s  new/old")
    for conc in (1, 8, 32):
        def run_old(j, e, p, c=conc):
            old.run_server(j, old_client, c, e, p)

        def run_new(j, e, p, c=conc):
            run_server(j, new_client, c, e, p)

        o = max(timed(run_old, a.requests) for _ in range(a.repeat))
        n = max(timed(run_new, a.requests) for _ in range(a.repeat))
        print(f"{conc:11d}  {o:26.0f}  {n:24.0f}  {n / o:7.2f}")
    server.shutdown()


if __name__ == "__main__":
    main()
