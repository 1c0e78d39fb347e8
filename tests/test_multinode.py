"""Two nodes rehearsed on one machine: two ``torchrun`` agents, a c10d rendezvous on 127.0.0.1, loopback only.

Each agent is one "node" (``--nnodes 2 --nproc-per-node 2``) running ``-m dflash train`` on a tiny random
Llama. With 1 target + 3 drafters, node 0 holds the target (rank 0) and the host drafter (rank 1), node 1
the drafters 2 and 3: the pair 0->1 is within a node, 0->2 and 0->3 cross nodes. The node of each rank
is the launcher's (``GROUP_RANK``), never guessed from the host name (both "nodes" are one host here);
the agents name themselves 127.0.0.1 and 127.0.0.2 (``--local-addr``, both loopback), and c10d numbers
the nodes in that order, so the first agent is node 0. Only node 0's agent hosts the rendezvous store
(``--rdzv-conf is_host=1``; node 1's ``is_host=0``): on one machine 127.0.0.1 is local to both agents, and
without it whichever started first hosted the store, so killing node 1 could take the store, and node 0's
agent with it, before node 0's ranks said what they saw.
The commands are the ones docs/guide/train-several-nodes.md shows.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash.core.records import read_records
from dflash.pipeline.launch import hung_ranks
from dflash.pipeline.ledger import read_ledger
from tests.test_distributed import assert_books_balance
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
AGENT_TIMEOUT_S = 240
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "DFLASH_WAIT_S": "60", "DFLASH_CHECK_TRANSFERS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(cfg: Path | None, outs: tuple[Path, Path], *train: str,
                torchrun: bool = True) -> list[subprocess.Popen]:
    """Both agents (``cfg`` None: ``train`` says ``--resume RUN``), the first as 127.0.0.1, node 0: torchrun's
    (c10d), or dflash's own launcher (``dflash train --nnodes 2 --node-rank R --rdzv-endpoint``, static)."""
    port = free_port()
    config = ["--config", str(cfg), "--out"] if cfg is not None else []

    def agent(node: int) -> list[str]:
        if not torchrun:
            return [sys.executable, "-m", "dflash", "train", "--nnodes", "2", "--node-rank", str(node),
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "2"]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "rehearsal", "--local-addr", f"127.0.0.{node + 1}",
                "--rdzv-conf", f"is_host={int(node == 0)}", "-m", "dflash", "train"]

    return [subprocess.Popen(
        [*agent(node), *config, *([str(out)] if cfg is not None else []), "--n-target", "1",
         "--n-drafter", "3", "--wandb", "disabled", *train],
        cwd=ROOT, env={**os.environ, **LOOPBACK}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True) for node, out in enumerate(outs)]


def finish(procs: list[subprocess.Popen], run: Path,
           timeout: float = AGENT_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Wait for the agents; one that outlives ``timeout`` fails the test naming what its ranks waited for."""
    done = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlocked on ranks: {hung_ranks(run)}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return done


def wait_for(what: Callable[[], bool], procs: list[subprocess.Popen], timeout: float = AGENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            finish(procs, Path("."), timeout=1)
            pytest.fail("the run ended or stalled before the point the test waits for")
        time.sleep(0.05)


@pytest.mark.slow
def test_two_nodes_use_a_plane_per_pair_lose_a_node_and_resume_each_item_once(tmp_path: Path,
                                                                             run_inputs) -> None:  # noqa: F811
    """Node 1's agent is SIGKILLed after a checkpoint; node 0 stops within 30 s naming node 1's ranks;
    both nodes relaunched with --resume (here by ``dflash train --nnodes 2``) finish with the ledger exact."""
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=40, checkpoint_every=2)
    run = tmp_path / "run"
    agents = start_nodes(cfg, (run, run))
    wait_for(lambda: len(read_ledger(run)) >= 3 and any(run.glob("checkpoint/step-*/manifest.json")), agents)
    os.kill(agents[1].pid, signal.SIGKILL)  # the agent; its ranks die with it (PR_SET_PDEATHSIG)
    t_kill = time.monotonic()
    survivor = finish(agents[:1], run, timeout=60)[0]
    stopped_s = time.monotonic() - t_kill
    agents[1].communicate()
    seen = f"after {stopped_s:.1f} s, exit {survivor.returncode}:\n{survivor.stderr[-3000:]}"  # CI's only view
    print(f"node 1 lost: node 0 stopped {stopped_s:.1f} s after the kill")  # the figure the notes state (-s)
    assert survivor.returncode != 0 and stopped_s < 30, seen
    assert "(node 1: ranks 2, 3)" in survivor.stderr, seen  # the lost node and its ranks, by the coordinator
    said = survivor.stdout
    assert "data plane shm for pairs 0->1 (node 0)" in said, said  # the pair within a node shares memory
    assert "data plane gloo for pairs 0->2 (across nodes), 0->3 (across nodes)" in said, said  # the others copy

    # the relaunch through dflash's own launcher on two nodes (the same ranks, a static rendezvous)
    again = finish(start_nodes(None, (run, run), "--resume", str(run), "--max-steps", "8", torchrun=False), run)
    assert [a.returncode for a in again] == [0, 0], [a.stderr[-2000:] for a in again]
    assert "resumed at step" in again[0].stdout
    s = assert_books_balance(run, 1, 3, sessions=2)
    ledger = read_ledger(run)
    trained = [i for _, ids in ledger for i in ids]
    assert [step for step, _ in ledger] == list(range(8)) and s["steps"] == 8
    assert len(trained) == s["trained"] == 24 and max(Counter(trained).values()) == 1  # each item once
    places = s["placement"]["ranks"]  # every rank: its node (the launcher's) and its rank on that node
    assert {r: (p["node"], p["local_rank"]) for r, p in places.items()} == {
        "0": (0, 0), "1": (0, 1), "2": (1, 0), "3": (1, 1)}
    assert s["placement"]["pairs"] == {"0->1": "shm", "0->2": "gloo", "0->3": "gloo"}
    for r in [*read_records(run, "produce"), *read_records(run, "take")]:
        assert (r["node"], r["local_rank"]) == (places[str(r["rank"])]["node"], places[str(r["rank"])]["local_rank"])


@pytest.mark.slow
def test_a_node_that_cannot_see_the_run_directory_fails_at_start_naming_it(tmp_path: Path,
                                                                           run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=2)
    run, elsewhere = tmp_path / "run", tmp_path / "not-mounted" / "run"
    agents = finish(start_nodes(cfg, (run, elsewhere)), run)
    for a in agents:  # each rank: one line, exit 2 (torchrun then reports its children's exit codes)
        assert a.returncode != 0 and "Traceback" not in a.stderr.split("dflash train: error:")[-1].split("\n")[0]
    lines = [x for a in agents for x in a.stderr.splitlines() if x.startswith("dflash train: error:")]
    assert all("exitcode  : 2" in a.stderr for a in agents)  # the bad input's status, on both nodes
    # Each rank says why, in one line of its own: the blind node's ranks name the path and their node, node 0's
    # name the blind node and its ranks. Every rank prints before the ranks leave together (rank.py's
    # _leave_together), in one write: two ranks of a node printing at once used to run their lines together.
    blind = [x for x in lines if "does not exist on node 1" in x]
    seen = [x for x in lines if "not visible on node(s) 1 (ranks 2, 3)" in x]
    said = "\n".join(a.stderr for a in agents)
    assert len(blind) == len(seen) == 2 and len(lines) == 4, said  # one line a rank, nothing else said
    assert all(str(elsewhere) in x for x in blind)  # the path and the node, by its ranks
    assert not elsewhere.parent.exists()  # nothing created where the node looked
    assert not (run / "ledger.jsonl").exists()  # nothing trained


def test_a_resumed_run_directory_missing_on_a_node_is_one_line_naming_the_node(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.cli.options import Opt, check_pure
    from dflash.core.errors import ConfigError

    resume, missing = Opt("--resume", "indir", "resume the run in this directory"), str(tmp_path / "not-mounted")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"--resume: must be an existing directory on node 1 \(host .+\)") as e:
        check_pure(resume, missing)
    assert "\n" not in e.value.line() and missing in e.value.line()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node: no node to name
    with pytest.raises(ConfigError, match="must be an existing directory \\(got"):
        check_pure(resume, missing)


def test_several_nodes_of_dflash_s_own_launcher_need_a_rendezvous_endpoint_and_a_node_rank() -> None:
    from dflash.core.errors import ConfigError
    from dflash.pipeline.nodes import Nodes

    assert Nodes.from_flags(None, None, None, under_launcher=False) == Nodes()
    two = Nodes.from_flags(2, 1, "10.0.0.1:29400", under_launcher=False)
    assert two.several and list(two.own_ranks(4)) == [4, 5, 6, 7]
    for flags, says in [((2, 0, None), "--nnodes: above 1 needs --rdzv-endpoint HOST:PORT"),
                        ((2, None, "h:29400"), "--node-rank: must be given with --nnodes 2"),
                        ((2, 2, "h:29400"), "--node-rank: must be below --nnodes (2)"),
                        ((2, 0, "h"), "--rdzv-endpoint: must be HOST:PORT"),
                        ((None, 1, None), "--node-rank: is only for several nodes")]:
        with pytest.raises(ConfigError) as e:
            Nodes.from_flags(*flags, under_launcher=False)
        assert e.value.line().startswith(says) and "\n" not in e.value.line()
    with pytest.raises(ConfigError, match="--nnodes: is the launcher's own flag"):
        Nodes.from_flags(2, 0, "h:1", under_launcher=True)
