"""One rank of the distributed trainer: set-up by role, the loop, and the host rank's end of run.

Every rank: the process group (``cpu:gloo,cuda:nccl``, with a timeout), the drafter ranks' own group,
its model replica (a target rank: the frozen target on its device; a drafter rank: a drafter built
from the target's embedding/LM head, identical on every drafter rank), the data (every rank forms an
item from its id alone). The host rank (the first drafter rank) also resolves the resume (the newest
verified checkpoint, the ledger and records cut back to it), starts the coordinator thread and
broadcasts its address and the start step; every rank then connects to the control channel.

A failing rank writes one line into ``RUN/.ranks/rank-N.error`` (the launcher prints the earliest)
and exits non-zero; a rank that waits names what it waits for in ``RUN/.ranks/rank-N.status``. An
unexpected exception (anything but a ConfigError, which stays one line) also leaves its full
traceback in ``RUN/.ranks/rank-N.traceback``, and the one line names that file; a later start of
the run moves it to ``RUN/.ranks/earlier/`` (:func:`archive_tracebacks`) instead of deleting it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError, JointConfigError
from dflash.core.precision import autocast_on, state_dtype_name
from dflash.pipeline.abort import FAILURE, LOST_PEER_GRACE_S, RANKS_DIR, AbortOnPeerFailure, Heartbeat
from dflash.pipeline.channel import Channel, ChannelError, connect
from dflash.pipeline.context import Corpus, DrafterContext, RankContext, Signals, Start, StopRule
from dflash.pipeline.hostmem import HostMemory, return_freed_memory
from dflash.pipeline.messages import Beat, Failed
from dflash.pipeline.paired import PairedTransport, settle
from dflash.pipeline.planes import node_plane, this_place
from dflash.pipeline.roles import DATA_NCCL, FALLBACK, Roles, check_world, device_for, plane_line
from dflash.pipeline.rundir import check_visible, may_create
from dflash.pipeline.stageclock import StageClock
from dflash.pipeline.workers import DrafterWorker, Producer, Status, capture_item

if TYPE_CHECKING:
    from dflash.pipeline.service import CoordinatorService

NVML_INTERVAL_S = 1.0  # power, clocks and utilisation of each rank's GPU, sampled this often
DATA_PLANE_ENV = "DFLASH_DATA_PLANE"  # auto (default) or a plane the placement allows (roles.choose_plane)
FAILED_RANK_GRACE_S = 1.0  # a failed rank waits this long before it exits (see rank_main)
LAUNCHED_BY_DFLASH = "DFLASH_LAUNCHER"  # set by dflash's own launcher: its parent prints the rank's error


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs, picklable (the launcher hands it to every process)."""

    cfg: DflashConfig
    out: str
    resume: bool = False
    wandb: str = "disabled"
    wait_s: float = 600.0  # longest wait for a take, an admit or a round (a longer one is a hang)
    pg_timeout_s: float = 600.0  # process-group timeout (tests: <= 60)
    check_transfers: bool = False  # fingerprint every item and re-form its tokens from its id on receipt
    quiet: bool = False


def needs_whole_target(cfg: DflashConfig, is_host_drafter: bool) -> bool:
    """Whether a drafter rank loads the whole target: only the host drafter rank, and only when
    ``train.eval_every`` runs real speculative decoding there (drafter_loop); every other drafter rank
    reads just the embedding and LM head from the checkpoint (dflash.model.target.load_target_tables)."""
    return bool(cfg.train.eval_every) and is_host_drafter


def roles_from_env(cfg: DflashConfig) -> Roles:
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    check_world(cfg.cluster.n_target, cfg.cluster.n_drafter, world)
    return Roles(rank=int(env.get("RANK", "0")), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))), n_target=cfg.cluster.n_target,
                 n_drafter=cfg.cluster.n_drafter)


def rank_main(spec: RunSpec) -> int:
    """The entry of every rank (a spawned process of the launcher, or a torchrun worker)."""
    _die_with_parent()
    _keep_fds_from_helpers()
    out = Path(spec.out)
    world = os.environ.get("WORLD_SIZE", "1")
    if may_create(out, int(os.environ.get("LOCAL_WORLD_SIZE", world)), int(world)):  # else: checked with its peers
        (out / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    status = Status(out / RANKS_DIR / f"rank-{rank}.status", rank)
    rr: RankRun | None = None

    def fail(exc: BaseException) -> None:
        """The rank's failure, from its main thread or from the abort watchdog (dflash.pipeline.abort)."""
        line = _report_failure(out, rank, spec, status, exc)
        channel = getattr(rr, "channel", None)
        if channel is not None:  # tell the coordinator: it fails with this cause and every rank leaves at once
            with contextlib.suppress(ChannelError, OSError):
                channel.send(Failed(line))
        # No teardown: a failed rank's peers are gone or going, and tearing down a process group with a
        # transfer still posted (a sharing plane's ack from a killed drafter, say) aborts in C++
        # ("terminate called without an active exception"), a second, misleading error. The launcher
        # names the first rank it sees exit, so a rank that failed because a peer vanished lingers a
        # moment (FAILED_RANK_GRACE_S, many launcher polls) for the peer that caused it to be seen first.
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(exc, JointConfigError):
            _leave_together()
        elif not isinstance(exc, ConfigError):
            time.sleep(FAILED_RANK_GRACE_S)
        os._exit(2 if isinstance(exc, ConfigError) else 1)

    FAILURE.install(fail)
    try:
        roles = roles_from_env(spec.cfg)
        rr = RankRun(spec, roles, status)
        code = rr.run()
    except BaseException as exc:
        if not FAILURE.claim():  # the watchdog is already reporting a thread's failure: it ends the process
            time.sleep(3600)
        fail(exc)
    if FAILURE.error is not None:  # a thread failed while the loop finished: the rank failed all the same
        if not FAILURE.claim():
            time.sleep(3600)
        fail(FAILURE.error)
    assert rr is not None  # every other way out of the try ended the process
    status.flush()
    if rr.signals.name is not None:  # the launcher is shutting down and waits for this process: leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class CoordinatorFailed(RuntimeError):
    """The host rank's coordinator thread failed (its exception is the cause, its time ``t`` the failure's)."""

    def __init__(self, exc: BaseException, t: float | None) -> None:
        super().__init__(f"the coordinator thread failed: {type(exc).__name__}: {exc}")
        self.t = t


def _report_failure(out: Path, rank: int, spec: RunSpec, status: Status, exc: BaseException) -> str:
    """One line for the launcher (the rank's .error file) and, under torchrun, on stderr."""
    role = "target" if rank < spec.cfg.cluster.n_target else "drafter"
    what = exc.line() if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    line = " ".join(f"rank {rank} ({role}, pid {os.getpid()}): {what}".split())
    if not (out / RANKS_DIR).is_dir():  # a node that cannot see the run directory (dflash.pipeline.rundir): say it
        if not os.environ.get(LAUNCHED_BY_DFLASH) or os.environ.get("LOCAL_RANK", "0") == "0":  # dflash's: once
            _say_error(line)
        return
    if not isinstance(exc, ConfigError):  # the one line says what; the file says where
        tb = out / RANKS_DIR / f"rank-{rank}.traceback"
        tb.write_text(f"{line}\n\n" + "".join(traceback.format_exception(exc)))
        line += f" (traceback: {tb})"
    # a coordinator failure dates from its thread, before its peers'; a thread's failure from when it happened
    t = getattr(exc, "t", None) or (FAILURE.t if FAILURE.error is exc else None) or time.time()
    (out / RANKS_DIR / f"rank-{rank}.error").write_text(json.dumps({"t": t, "line": line,
                                                                      "config": isinstance(exc, ConfigError)}))
    status(f"failed: {what}")
    status.flush()
    if not os.environ.get(LAUNCHED_BY_DFLASH):  # under torchrun nobody else prints it
        _say_error(line)
    return line


def _say_error(line: str) -> None:
    """The rank's one line on stderr, in one write. The ranks of a node share their agent's stderr, and
    ``print`` writes the text and its newline separately: two ranks failing at once (the run-directory check
    fails on every rank) then ran their lines together ("...the same path)dflash train: error: rank 0 ..."),
    and the second no longer began a line. One write of at most PIPE_BUF bytes to a pipe is atomic."""
    text = f"dflash train: error: {line}\n"
    sys.stderr.flush()
    try:
        fd, data = sys.stderr.fileno(), text.encode(errors="replace")
        while data:
            data = data[os.write(fd, data):]
    except (OSError, ValueError, AttributeError):  # no file descriptor (a library caller's captured stderr)
        sys.stderr.write(text)
        sys.stderr.flush()


def _leave_together(timeout_s: float = 30.0) -> None:
    """Every rank failed the same collective check and has said its line: meet once more before leaving, so
    the launcher's teardown, which starts at the first exit, finds every line already written. Bounded: a
    rank that never comes costs ``timeout_s`` (gloo's monitored barrier), and then each leaves anyway."""
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier()


def _leave_for_peer(out: Path, rank: int, status: Status, why: str) -> None:
    """A peer failed and the launcher stops this rank (dflash.pipeline.abort.AbortOnPeerFailure): leave now,
    with an error line dated now (later than the cause's, so the launcher still names the cause)."""
    if not FAILURE.claim():
        return
    line = f"rank {rank} (pid {os.getpid()}): {why}"
    with contextlib.suppress(OSError):
        (out / RANKS_DIR / f"rank-{rank}.error").write_text(json.dumps({"t": time.time(), "line": line,
                                                                          "config": False}))
    status(f"left: {why}")
    status.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def archive_tracebacks(ranks_dir: Path, rank: int | None = None) -> None:
    """Keep the tracebacks of an earlier start (all ranks', or one rank's) in ``earlier/``, named by rank and
    time, before a new start clears the rank files: a resume must not wipe the evidence of the failure
    that made it necessary. Nothing in ``earlier/`` is ever deleted (a few KB per failed start)."""
    pattern = "rank-*.traceback" if rank is None else f"rank-{rank}.traceback"
    for f in sorted(ranks_dir.glob(pattern)):
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(f.stat().st_mtime))
        dest = ranks_dir / "earlier" / f"{f.stem}.{stamp}.traceback"
        dest.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while dest.exists():
            dest, n = dest.with_name(f"{f.stem}.{stamp}-{n}.traceback"), n + 1
        os.replace(f, dest)


def _keep_fds_from_helpers() -> None:
    """Helper programs a rank starts (torch's ``torch_shm_manager``, used by CUDA IPC's ref counters)
    must not inherit the launcher's pipes: the launcher learns that a rank died when the rank's end of
    its sentinel pipe closes, and a daemon holding a copy hides the death (a killed rank hung the job)."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):  # an fd closed since the listing
                os.set_inheritable(fd, False)


def _die_with_parent() -> None:
    """A rank dies with the process that started it (a killed launcher leaves no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RankRun:
    """One rank's set-up, step by step; the loops it then runs read a frozen context (dflash.pipeline.context)."""

    def __init__(self, spec: RunSpec, roles: Roles, status: Status) -> None:
        self.spec, self.cfg, self.roles, self.status = spec, spec.cfg, roles, status
        self.out = Path(spec.out)
        self.signals = Signals()
        self._gpus: Any = None
        self.service: CoordinatorService | None = None  # the host rank's coordinator, set by _host_setup
        self.progress = (lambda _m: None) if spec.quiet or not roles.is_coordinator else \
            (lambda m: print(m, flush=True))

    # ------------------------------------------------------------------ set-up
    def run(self) -> int:
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # the plane of pairs within a node; pairs across nodes copy (dflash.pipeline.planes)
        self.plane = node_plane(cuda, self.roles.local_world_size, os.environ.get(DATA_PLANE_ENV, "auto"))
        self.device = torch.device(device_for(self.roles.local_rank, cuda))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(self.cfg.train.cpu_threads
                                  or max(1, (os.cpu_count() or 2) // self.roles.local_world_size))
            return_freed_memory()  # opt-in (DFLASH_RETURN_FREED_MEMORY=1): the peak follows what a step holds
        self._install_signal_handlers()
        AbortOnPeerFailure(self.out / RANKS_DIR, self.roles.rank,
                           lambda why: _leave_for_peer(self.out, self.roles.rank, self.status, why)).install()
        self.status("joining the process group")
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=self.spec.pg_timeout_s))
        self.drafter_group = dist.new_group(self.roles.drafter_ranks)
        check_visible(self.out, self.roles.rank, this_place(self.roles).node)  # every node sees the run directory
        if self.plane == DATA_NCCL:  # NCCL point-to-point: the world's first NCCL call must involve every rank
            dist.all_reduce(torch.zeros(1, device=self.device))
        self.planes = settle(self.roles, self.plane, self.device)
        if self.planes.refused is not None:
            self.plane = FALLBACK[self.plane]
        if len(set(self.planes.planes.values())) == 1:  # one plane for every pair: the one line it always was
            self.plane = next(iter(self.planes.planes.values()))
            self.progress(plane_line(self.plane, self.planes.refused))
        else:
            for line in self.planes.lines():
                self.progress(line)
        self._load()
        info = self._host_setup() if self.roles.is_coordinator else None
        box = [info]
        dist.broadcast_object_list(box, src=self.roles.coordinator_rank)
        self.info = box[0]
        self.channel = connect(self.info["host"], self.info["port"], self.roles.rank, self.spec.wait_s)
        heartbeat = Heartbeat(lambda: self.channel.send(Beat())).start()  # its silence: a dead rank (abort.py)
        if len({p.node for p in self.planes.places}) > 1:  # a lost coordinator's node is named in the one line
            host = self.planes.places[self.roles.coordinator_rank]
            self.channel.peer = f"the coordinator (rank {host.rank}, node {host.node})"
        self.ctx = RankContext(self.cfg, self.roles, self.out, self.device, self.plane, self.channel, self.status,
                               self.progress, self.spec.wait_s, StopRule(self.cfg.train, self.roles.is_coordinator,
                                                                         self.signals), self.gpu_samples)
        self.corpus = Corpus(self.target, self.data, self.sampler, tuple(self.layer_ids))
        self.memory = memory = HostMemory(self.out / RANKS_DIR, self.roles.rank,
                                          "target" if self.roles.is_target else "drafter")
        memory.before()  # the memory model is checked against the loop's own peak (dflash/pipeline/hostmem.py)
        if self.roles.is_target:
            self._run_producer()
        else:
            try:
                self._run_drafter()
            except BaseException as exc:
                failed = self._coordinator_cause(exc)
                if failed is None or failed is exc:
                    raise
                # the host's coordinator thread failed first: that is the cause, not the channel it closed
                raise CoordinatorFailed(failed, self.service.error_t) from failed
        memory.after()
        heartbeat.stop()
        dist.destroy_process_group()  # only after a clean run: a failure leaves without teardown (rank_main)
        return 0

    def _coordinator_cause(self, exc: BaseException) -> BaseException | None:
        """The host rank's coordinator thread's failure, if it has one: the cause of ``exc`` (a collective that
        broke because a rank vanished fails here first, often before the coordinator reads the lost channel,
        so a failure that is not a stop or a bad input waits for it up to a grace; a failure of this rank's
        own then leaves that much later)."""
        if self.service is None:
            return None
        if isinstance(exc, (KeyboardInterrupt, SystemExit, ConfigError)):
            return self.service.error
        return self.service.wait_error(LOST_PEER_GRACE_S + 1.0)

    def _load(self) -> None:
        from dflash.model.target import HiddenStateCapture, capture_layer_ids, load_target, load_target_tables
        from dflash.pipeline.training_data import TrainingData

        self.status("loading the target and the data")
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        tables = None
        if not self.roles.is_target and not needs_whole_target(self.cfg, self.roles.is_coordinator):
            tables = load_target_tables(self.cfg.target.model, dtype=dtype)  # embedding and LM head only
        # a target rank loads straight onto its device; a drafter rank holds the whole target (on the host) only
        # where it runs train.eval_every's speculative decoding, or where no local checkpoint has the tables
        self.target = tables or load_target(self.cfg.target.model, device=self.device if self.roles.is_target
                                             else "cpu", dtype=dtype)
        self.layer_ids = capture_layer_ids(self.target.num_layers, self.cfg.target.capture_layers)
        self.data = TrainingData(self.cfg, self.target.tokenizer)
        self.sampler = self.data.sampler
        self.autocast = autocast_on(self.device.type)  # the precision rule: dflash.core.precision
        self.state_dtype = getattr(torch, state_dtype_name(self.device.type))
        if self.roles.is_target:
            self.capture = HiddenStateCapture(self.target.model, self.layer_ids)
        else:
            self._build_drafter()

    def _build_drafter(self) -> None:
        from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
        from dflash.pipeline.optim import LrSchedule, build_optimizer

        cfg = self.cfg
        spec = DrafterSpec.from_target_config(self.target.config, target_layer_ids=self.layer_ids,
                                              mask_token_id=default_mask_token_id(self.target.tokenizer),
                                              drafter=cfg.drafter)
        torch.manual_seed(cfg.seed)
        self.drafter = DFlashDrafter.from_target(self.target.model, spec, device=self.device, dtype=torch.float32)
        self.reduce_device = self.device if self.plane == DATA_NCCL else torch.device("cpu")
        for t in self.drafter.state_dict().values():  # every drafter rank starts from the first one's weights
            buf = t.detach().to(self.reduce_device)
            dist.broadcast(buf, src=self.roles.coordinator_rank, group=self.drafter_group)
            t.data.copy_(buf)
        self.optimizer = build_optimizer(self.drafter.trainable_parameters(), cfg.train)
        self.scheduler = LrSchedule(self.optimizer, cfg.train)

    def _host_setup(self) -> dict[str, Any]:
        """The coordinator thread, after the resume is resolved; returns what every rank must know."""
        from dflash.pipeline.resume import resolve_resume
        from dflash.pipeline.service import CoordinatorService, ResumeState

        self.status("starting the coordinator")
        address = _reachable_address()  # the coordinator listens there only (loopback when MASTER_ADDR is)
        if self.spec.resume:
            start_step, run_id, state, ckpt = resolve_resume(self.out, self.progress)
        else:
            start_step, run_id, state, ckpt = 0, f"real-{uuid.uuid4().hex[:8]}", ResumeState(), None
            if not (self.out / "config.json").exists():
                from dflash.core.run_config import write_run_config

                write_run_config(self.out, self.cfg)
        self.service = CoordinatorService(self.cfg, self.roles, self.sampler, self.out, run_id, resume=state,
                                          wait_s=self.spec.wait_s, progress=self.progress, placement=self.planes,
                                          bind=address)
        self.service.start()
        return {"host": address, "port": self.service.hub.port, "start_step": start_step,
                "run_id": run_id, "checkpoint": None if ckpt is None else str(ckpt)}

    def gpu_samples(self) -> list[dict[str, Any]]:
        """This rank's GPU, sampled through NVML since the last call (empty on the CPU or without NVML)."""
        if self.device.type != "cuda":
            return []
        if self._gpus is None:
            from dflash.pipeline.telemetry import NvmlSampler, nvml_device_for

            warn = self.progress if self.roles.is_coordinator else (lambda _m: None)
            gpu = nvml_device_for(self.device.index or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._gpus = NvmlSampler(NVML_INTERVAL_S, indices=[gpu], warn=warn).start()
        return self._gpus.drain()

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self.signals.name = f"signal {signal.Signals(signum).name}"

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, handler)

    def _transport(self) -> PairedTransport:
        """This rank's data plane: each pair's own (dflash.pipeline.planes)."""
        return PairedTransport(self.planes, self.roles.rank, self.device)

    # ------------------------------------------------------------------ target
    def _run_producer(self) -> None:
        from dflash.pipeline.heldout import prepare_on_target

        # train.quality_every: the held-out set's states, once, before producing
        prepare_on_target(self.ctx, self.corpus, self.capture, self.state_dtype)
        transport = self._transport()
        clock = StageClock(self.device)

        def make(spec: Any) -> tuple[torch.Tensor, ...]:
            return capture_item(self.data, self.target, self.capture, spec, self.device, self.state_dtype, clock)

        Producer(self.channel, transport, make, self.sampler.item, check=self.spec.check_transfers,
                 status=self.status, gpu=self.gpu_samples, clock=clock).run()
        self.status("finished")

    # ------------------------------------------------------------------ drafter
    def _run_drafter(self) -> None:
        from dflash.pipeline.drafter_loop import DrafterLoop

        new_phase = None  # a learning-rate phase opened at resume (an extended run)
        if self.info["checkpoint"]:
            state = torch.load(Path(self.info["checkpoint"]) / "state.pt", weights_only=False, map_location="cpu")
            self.drafter.load_state_dict(state["drafter"])
            self.optimizer.load_state_dict(state["optimizer"])
            new_phase = self.scheduler.load_state_dict(
                state["scheduler"], step=int(self.info["start_step"]), elapsed_s=float(state.get("elapsed_s", 0.0)),
                train=self.cfg.train)
        worker = DrafterWorker(self.channel, self._transport(), self.drafter, self.optimizer,
                               self.scheduler, group=self.drafter_group, reduce_device=self.reduce_device,
                               device=self.device, seed=self.cfg.seed, grad_clip=self.cfg.train.grad_clip,
                               autocast=self.autocast, wait_s=self.spec.wait_s, check=self.spec.check_transfers,
                               status=self.status, verify_ids=self._verify_ids if self.spec.check_transfers else None)
        worker.step = self.memory.each_step(worker.step)  # type: ignore[method-assign]  # the per-step peak
        start = Start(int(self.info["start_step"]), str(self.info["run_id"]), self.info["checkpoint"])
        DrafterLoop(DrafterContext(self.ctx, self.corpus, self.drafter, self.optimizer, self.scheduler, start,
                                   self.spec.wandb, new_phase, self.service), worker).run()

    def _verify_ids(self, item_id: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """The received tokens must be the tokens this rank forms from the item's id."""
        from dflash.model.target import collate

        spec = self.sampler.item(item_id)
        pad = self.target.tokenizer.pad_token_id
        input_ids, _, _ = collate([self.data.encode(i) for i in spec.seq_indices], pad if pad is not None else 0)
        if not torch.equal(input_ids, tensors[1].cpu()):
            raise RuntimeError(f"item {item_id}: the received tokens are not the item's tokens (swapped transfer)")

def _reachable_address() -> str:
    """The address other ranks reach this host by: the interface that routes to MASTER_ADDR."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


__all__ = ["RANKS_DIR", "Channel", "RankRun", "RunSpec", "rank_main"]
