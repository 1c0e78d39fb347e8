"""The data plane: an item's tensors move producer -> drafter point-to-point in globally numbered rounds.

Each rank runs its part of round ``r`` in increasing ``r``; the coordinator numbers the rounds, so
crossed producer/drafter pairs cannot deadlock. Shapes and dtypes come in the control message
(``meta``), so the receiver lays out its tensors before anything arrives. A producer's tensors are
untouched until its send completes.

Five kinds, one interface (:class:`Transport`), chosen by placement (:mod:`dflash.pipeline.roles`):

- ``gloo``: CPU tensors over gloo (the CPU fallback, and CPU ranks on several nodes);
- ``nccl``: device to device (one GPU per rank);
- ``host``: one GPU shared by the node's ranks, staged through host memory over gloo (the fallback
  where CUDA IPC is refused: NCCL refuses two ranks on one device);
- ``cuda-ipc`` and ``shm``: ranks of one node *share* the producer's buffer instead of copying it
  (:class:`SharingTransport`). The producer packs the item into a pooled shared buffer (device memory
  for CUDA IPC, an anonymous shared-memory file for shm) and sends only its handle (a small uint8 tensor over
  gloo, in the item's round); the drafter maps the buffer (once per buffer: mappings are cached) and
  trains on views of it; its :meth:`Transport.release` sends a one-byte ack back (tag derived from
  the round), and only then does the producer's sender thread return the buffer to its pool. So the
  ownership rule holds: the producer keeps the bytes until the drafter says it is done with them.

Every receive returns a :class:`Lease`: the tensors plus whatever backs them, and ``release(lease)``
returns exactly that (pooled buffers are found by identity; tensors are never compared by value and
no ``id()`` of a derived tensor is kept, which is what crashed the first GPU run).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dflash.pipeline.roles import DATA_GLOO, DATA_HOST, DATA_IPC, DATA_NCCL, DATA_SHM

POOL_BUFFERS = 4  # free buffers kept for reuse per pool
ALIGN = 64  # byte alignment of each tensor inside a flat buffer
HANDLE_BYTES = 4096  # fixed size of a sharing plane's handle message (length-prefixed pickle)
MAPPED_PER_PEER = 8  # mapped producer buffers a drafter keeps open per producer
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor, and a fingerprint to check what arrived."""

    shape: tuple[int, ...]
    dtype: str


def describe(tensors: tuple[torch.Tensor, ...]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(t.shape), str(t.dtype)) for t in tensors)


def fingerprint(tensors: tuple[torch.Tensor, ...]) -> str:
    """A content hash (sha1 of the bytes) the receiver recomputes: a swapped or damaged transfer fails."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def nbytes(metas: tuple[TensorMeta, ...]) -> int:
    return sum(torch.Size(m.shape).numel() * DTYPES[m.dtype].itemsize for m in metas)


def layout(metas: tuple[TensorMeta, ...]) -> tuple[list[int], list[int], int]:
    """Byte offsets and sizes of the tensors inside one flat buffer (each aligned), and its total size."""
    sizes = [torch.Size(m.shape).numel() * DTYPES[m.dtype].itemsize for m in metas]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    return offsets, sizes, total


def views(flat: torch.Tensor, metas: tuple[TensorMeta, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors ``metas`` describes, as views of the flat uint8 buffer ``flat``."""
    offsets, sizes, _ = layout(metas)
    return tuple(flat[o:o + n].view(DTYPES[m.dtype]).view(m.shape)
                 for o, n, m in zip(offsets, sizes, metas, strict=True))


def pack(tensors: tuple[torch.Tensor, ...], flat: torch.Tensor, non_blocking: bool = False
         ) -> tuple[torch.Tensor, ...]:
    """Copy ``tensors`` into ``flat`` (one copy each); returns the views they now live in. ``non_blocking``:
    the copies are only queued (a pinned host ``flat``); the caller waits for them before the bytes are read."""
    out = views(flat, describe(tensors))
    for dst, src in zip(out, tensors, strict=True):
        dst.copy_(src, non_blocking=non_blocking)
    return out


class BufferPool:
    """Flat uint8 buffers of one device kept for reuse: the smallest free one that fits is taken.

    A fresh buffer is as large as the largest taken so far, so the pool settles on a few buffers that
    fit every item (length buckets make items of a few sizes) instead of chasing each new size.

    Buffers are found and removed by identity (``is``), never by ``==`` (which compares tensors by
    value) and never by ``id()`` of a view. Thread-safe: a producer takes in one thread and gives back
    in another. ``allocated`` counts fresh allocations (reuse leaves it unchanged).
    """

    def __init__(self, device: torch.device, keep: int = POOL_BUFFERS,
                 make: Callable[[int], torch.Tensor] | None = None,
                 drop: Callable[[torch.Tensor], None] | None = None) -> None:
        self.device, self.keep = device, keep
        self._make = make or (lambda n: torch.empty(n, dtype=torch.uint8, device=device))
        self._drop = drop  # called for a buffer the pool lets go of (a shared buffer closes its handle)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0
        self._largest = 1

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            self.allocated += 1
            self._largest = max(self._largest, nbytes)
            size = self._largest
        return self._make(size)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if any(b is buf for b in self._free):
                raise RuntimeError("a pooled buffer was given back twice")
            self._free.append(buf)
            if len(self._free) > self.keep:  # keep the largest: they fit every item the smaller ones fit
                dropped = self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
                if self._drop is not None:
                    self._drop(dropped)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass(eq=False)
class Lease:
    """Received tensors and what backs them; give it back with :meth:`Transport.release` when done."""

    tensors: tuple[torch.Tensor, ...]
    buffer: torch.Tensor | None = None  # the pooled buffer the tensors view (gloo, nccl, host)
    ack: tuple[int, int] | None = None  # (producer rank, round) a sharing plane acknowledges
    released: bool = False


@dataclass
class PendingSend:
    """A posted send: its works and the tensors they read (kept alive until the send completes)."""

    works: list[Any]
    tensors: tuple[torch.Tensor, ...]
    t0: float
    done: Callable[[], None] | None = None  # returns the send's pooled buffer, after every work finished
    seconds: float = field(default=0.0)

    def wait(self) -> float:
        for w in self.works:
            w.wait()
        self.tensors = ()
        if self.done is not None:
            self.done()
            self.done = None
        return time.perf_counter() - self.t0


def data_tag(rnd: int) -> int:
    return rnd % (1 << 30)


def ack_tag(rnd: int) -> int:
    """The drafter's done-with-it ack of round ``rnd`` (the other direction, its own tag space)."""
    return (1 << 30) | (rnd % (1 << 30))


class Transport:
    """Send / receive one item's tensors in round ``r`` with its peer (gloo and NCCL: straight into a pooled buffer)."""

    kind: str

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.pool = BufferPool(device)  # receive buffers on this rank's device

    @property
    def wire(self) -> torch.device:
        return self.device

    def post_send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> PendingSend:
        """Post this rank's part of round ``rnd`` (returns at once); the tensors live until ``wait`` returns."""
        t0 = time.perf_counter()
        wire = tuple(t.to(self.wire).contiguous() for t in tensors)
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group, tag=data_tag(rnd)) for t in wire]
        return PendingSend(dist.batch_isend_irecv(ops), wire, t0)

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> float:
        """Blocking send of round ``rnd``; returns seconds spent."""
        return self.post_send(tensors, dst, rnd).wait()

    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[Lease, float]:
        """Blocking receive of round ``rnd`` on this rank's device; returns the lease and seconds.

        The tensors are views of one pooled buffer; give the lease back with :meth:`release` when done
        (the next receive reuses the buffer instead of faulting in fresh pages, which costs as much as
        the copy).
        """
        t0 = time.perf_counter()
        buf = self.pool.take(layout(metas)[2])
        out = views(buf, metas)
        self._irecv_into(out, src, rnd)
        return Lease(out, buf), time.perf_counter() - t0

    def release(self, lease: Lease, settled: bool = False) -> None:
        """The caller no longer uses the lease's tensors: what backs them may be reused (``settled``: the caller
        has already seen every kernel that read them finish, so a sharing plane need not wait again)."""
        if lease.released:
            raise RuntimeError("a received item was released twice")
        lease.released, lease.tensors = True, ()
        if lease.buffer is not None:
            self.pool.give(lease.buffer)
            lease.buffer = None

    def _irecv_into(self, bufs: tuple[torch.Tensor, ...], src: int, rnd: int) -> None:
        ops = [dist.P2POp(dist.irecv, b, src, group=self.group, tag=data_tag(rnd)) for b in bufs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


class GlooTransport(Transport):
    kind = DATA_GLOO


class NcclTransport(Transport):
    kind = DATA_NCCL


class HostStagedTransport(Transport):
    """One shared GPU without CUDA IPC: the bytes go device -> host -> gloo -> host -> device.

    Both ends stage through a pooled host buffer (one flat copy each way); the drafter's tensors are
    views of a pooled device buffer, which its lease returns. Where CUDA exists the staging buffers are
    pinned and the copies ``non_blocking`` (issue 34: a synchronous copy from pageable memory took
    0.3-0.6 s per 671 MB item): the producer waits for its copy on its current (send) stream only, before
    gloo reads the bytes; the drafter's copy to the device is queued, and its staging buffer goes back to
    the pool once an event after the copy has completed (:meth:`_reclaim`), with no host wait.
    """

    kind = DATA_HOST

    def __init__(self, device: torch.device, group: Any = None) -> None:
        super().__init__(device, group)
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.pinned = pin
        self.staging = BufferPool(torch.device("cpu"), make=(lambda n: torch.empty(n, dtype=torch.uint8,
                                                                                    pin_memory=True)) if pin else None)
        self._cooling: list[tuple[torch.Tensor, Any]] = []  # (staging buffer, event after its copy to the device)

    @property
    def wire(self) -> torch.device:
        return torch.device("cpu")

    def post_send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> PendingSend:
        t0 = time.perf_counter()
        host = self.staging.take(layout(describe(tensors))[2])
        wire = pack(tensors, host, non_blocking=self.pinned)
        if self.pinned:  # the copies ran on this thread's current stream: wait for them, not for the device
            torch.cuda.current_stream(self.device).synchronize()
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group, tag=data_tag(rnd)) for t in wire]
        return PendingSend(dist.batch_isend_irecv(ops), wire, t0, done=lambda: self.staging.give(host))

    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[Lease, float]:
        from dflash.pipeline.streams import new_event

        t0 = time.perf_counter()
        self._reclaim()
        total = layout(metas)[2]
        host = self.staging.take(total)
        self._irecv_into(views(host, metas), src, rnd)
        buf = self.pool.take(total)
        buf[:total].copy_(host[:total], non_blocking=self.pinned)  # one copy of the whole item, queued
        done = new_event(self.device)
        done.record()
        self._cooling.append((host, done))
        return Lease(views(buf, metas), buf), time.perf_counter() - t0

    def _reclaim(self) -> None:
        """Staging buffers whose copy to the device has finished go back to the pool (events complete in order)."""
        while self._cooling and self._cooling[0][1].query():
            self.staging.give(self._cooling.pop(0)[0])

    @property
    def cooling(self) -> int:
        return len(self._cooling)


class SharingTransport(Transport):
    """The producer's buffer is mapped by the drafter: only a handle travels, and an ack comes back.

    Subclasses say how a buffer is allocated shareable, how its handle is written and how a handle
    is mapped in another process (:meth:`_shareable`, :meth:`_handle`, :meth:`_map`).
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        super().__init__(device, group)
        self.send_pool = BufferPool(device, make=self._shareable, drop=self._unshare)  # producer side: shared
        self._mapped: dict[int, OrderedDict[Any, torch.Tensor]] = {}  # drafter side: per producer, LRU

    # -- the producer
    def post_send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> PendingSend:
        t0 = time.perf_counter()
        buf = self.send_pool.take(layout(describe(tensors))[2])
        pack(tensors, buf)
        self._settle()  # the bytes are in place before the drafter can read them
        msg = encode_handle(self._handle(buf))
        ack = torch.zeros(1, dtype=torch.uint8)
        works = [dist.isend(msg, dst, group=self.group, tag=data_tag(rnd)),
                 dist.irecv(ack, dst, group=self.group, tag=ack_tag(rnd))]
        return PendingSend(works, (msg, ack, buf), t0, done=lambda: self.send_pool.give(buf))

    # -- the drafter
    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[Lease, float]:
        t0 = time.perf_counter()
        msg = torch.empty(HANDLE_BYTES, dtype=torch.uint8)
        dist.irecv(msg, src, group=self.group, tag=data_tag(rnd)).wait()
        key, handle = decode_handle(msg)
        need = layout(metas)[2]
        flat = self._open(src, key, handle, need)
        if flat.numel() < need:
            raise RuntimeError(f"round {rnd}: rank {src}'s shared buffer holds {flat.numel()} bytes, "
                               f"fewer than the item's {need}")
        return Lease(views(flat, metas), ack=(src, rnd)), time.perf_counter() - t0

    def release(self, lease: Lease, settled: bool = False) -> None:
        ack = lease.ack
        super().release(lease)
        if ack is not None:
            if not settled:
                self._settle()  # every kernel that read the views has finished before the producer may reuse them
            src, rnd = ack
            dist.send(torch.ones(1, dtype=torch.uint8), src, group=self.group, tag=ack_tag(rnd))

    def _open(self, src: int, key: Any, handle: Any, need: int) -> torch.Tensor:
        cache = self._mapped.setdefault(src, OrderedDict())
        cached = cache.get(key)
        if cached is not None and cached.numel() < need:  # a new, larger buffer where a freed one was: map it anew
            del cache[key], cached
        flat = self._map(handle, cache.get(key))
        cache[key] = flat
        cache.move_to_end(key)
        while len(cache) > MAPPED_PER_PEER:
            cache.popitem(last=False)  # unmapped here; the producer still owns it
        return flat

    # -- per kind
    def _settle(self) -> None:
        """Wait for this rank's queued device work (a no-op on the CPU)."""

    def _shareable(self, n: int) -> torch.Tensor:
        raise NotImplementedError

    def _unshare(self, buf: torch.Tensor) -> None:
        """The producer's pool let go of ``buf`` (drafters that mapped it keep their mapping until they drop it)."""

    def _handle(self, buf: torch.Tensor) -> tuple[Any, Any]:
        raise NotImplementedError

    def _map(self, handle: Any, cached: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class ShmTransport(SharingTransport):
    """CPU ranks of one node: the producer's buffer is an anonymous shared-memory file (``memfd``), which a
    drafter maps through ``/proc/<producer pid>/fd/<fd>``.

    Not torch's own CPU sharing (``file_system``): that starts a ``torch_shm_manager`` daemon per rank,
    which inherits the launcher's process sentinel, so a rank killed by a signal is not seen as dead
    while its manager lives (a killed drafter hung the job). A memfd needs no daemon and leaves nothing
    behind: its memory is freed when the last process holding it exits or unmaps it, however it ends.
    A handle is (pid, fd, size, serial); the serial keeps a drafter's mapping cache right when a closed
    fd number is reused for a new buffer.
    """

    kind = DATA_SHM

    def __init__(self, device: torch.device, group: Any = None) -> None:
        super().__init__(device, group)
        self._fds: list[tuple[torch.Tensor, int, int]] = []  # (buffer, fd, serial), found by identity
        self._serial = 0
        self._fd_lock = threading.Lock()  # buffers are made and shared in one thread, dropped in another

    def _shareable(self, n: int) -> torch.Tensor:
        fd = os.memfd_create("dflash-item")
        os.ftruncate(fd, n)
        buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=n, dtype=torch.uint8)
        with self._fd_lock:
            self._serial += 1
            self._fds.append((buf, fd, self._serial))
        return buf

    def _unshare(self, buf: torch.Tensor) -> None:
        with self._fd_lock:
            i = next(i for i, (b, _, _) in enumerate(self._fds) if b is buf)
            os.close(self._fds.pop(i)[1])

    def _handle(self, buf: torch.Tensor) -> tuple[Any, Any]:
        with self._fd_lock:
            fd, serial = next((fd, serial) for b, fd, serial in self._fds if b is buf)
        pid = os.getpid()
        return (pid, serial), (pid, fd, buf.numel())

    def _map(self, handle: Any, cached: torch.Tensor | None) -> torch.Tensor:
        if cached is not None:
            return cached
        pid, fd, n = handle
        return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=n, dtype=torch.uint8)


class CudaIpcTransport(SharingTransport):
    """Ranks sharing one GPU: the producer's device buffer is opened by the drafter through CUDA IPC
    (torch's own CUDA tensor sharing); no byte leaves the device.

    Each pooled buffer is shared once (issue 34): its handle is made when the buffer is first sent and
    reused for every later item in it, and dropped with the buffer; the drafter maps a handle once and
    reuses the mapping (:meth:`SharingTransport._open`). Sharing on every send nested another IPC
    bookkeeping record per item in torch's ``reductions`` (by a reading of that code), and mapping on
    every receive rebuilt the tensor per item. ``_reduce`` and ``_rebuild`` are the only CUDA calls, so
    the bookkeeping runs (and is tested) on the CPU.
    """

    kind = DATA_IPC

    def __init__(self, device: torch.device, group: Any = None) -> None:
        super().__init__(device, group)
        self._shared: list[tuple[torch.Tensor, tuple[Any, Any]]] = []  # (buffer, its handle), found by identity
        self._share_lock = threading.Lock()  # shared in the reader thread, dropped in the sender thread
        self.shares = 0  # handles made (one per pooled buffer)
        self.maps = 0  # mappings made on the drafter side (one per buffer it was sent)

    def _settle(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _shareable(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def _handle(self, buf: torch.Tensor) -> tuple[Any, Any]:
        with self._share_lock:
            for b, handle in self._shared:
                if b is buf:
                    return handle
        args = self._reduce(buf)
        handle = ((args[7], args[9]), args)  # (CUDA allocation handle, offset in it), the rebuild arguments
        with self._share_lock:
            self._shared.append((buf, handle))
            self.shares += 1
        return handle

    def _unshare(self, buf: torch.Tensor) -> None:
        with self._share_lock:
            self._shared = [(b, h) for b, h in self._shared if b is not buf]

    def _map(self, handle: Any, cached: torch.Tensor | None) -> torch.Tensor:
        if cached is not None:
            return cached
        self.maps += 1
        return self._rebuild(handle)

    # the two CUDA calls
    def _reduce(self, buf: torch.Tensor) -> tuple[Any, ...]:
        from torch.multiprocessing.reductions import reduce_tensor

        return tuple(reduce_tensor(buf)[1])

    def _rebuild(self, args: Any) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*args)


def encode_handle(obj: Any) -> torch.Tensor:
    """A pickled handle as a fixed-size uint8 tensor (4-byte length, then the bytes)."""
    data = pickle.dumps(obj)
    if len(data) + 4 > HANDLE_BYTES:
        raise RuntimeError(f"a shared-buffer handle of {len(data)} bytes exceeds {HANDLE_BYTES - 4}")
    out = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    out[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    out[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_handle(msg: torch.Tensor) -> Any:
    raw = msg.numpy().tobytes()
    n = int.from_bytes(raw[:4], "little")
    return pickle.loads(raw[4:4 + n])  # a peer rank of this job, over the job's own process group


def probe_sharing(kind: str, device: torch.device, peers: frozenset[int] | None = None) -> str | None:
    """Can every rank of the job map every other rank's shared buffer? None if so, else the first refusal.

    ``peers``: the ranks whose buffers this rank maps (its own node's: sharing never crosses a node,
    dflash.pipeline.planes); every rank's by default.

    A collective over the whole world (every rank calls it): each rank shares a small buffer holding
    its rank number, gathers everyone's handles, maps the others' and checks the bytes. Sharing can be
    refused by the place, not the code (no ``/dev/shm``, a container without IPC rights), so the ranks
    try it together and fall back together.
    """
    transport = make_transport(kind, device)
    assert isinstance(transport, SharingTransport)
    rank, reason, handle = dist.get_rank(), None, None
    try:
        buf = transport.send_pool.take(ALIGN)
        buf.fill_(rank % 251 + 1)
        transport._settle()
        handle = transport._handle(buf)[1]
    except Exception as exc:  # refused here: say why, still take part in the gather
        reason = f"rank {rank}: {type(exc).__name__}: {exc}"
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (handle, reason))
    for peer, (peer_handle, why) in enumerate(got):
        if peer == rank or reason is not None or (peers is not None and peer not in peers):
            continue
        if peer_handle is None:
            reason = why
            continue
        try:
            flat = transport._map(peer_handle, None)
            if not bool((flat[:ALIGN] == peer % 251 + 1).all()):
                reason = f"rank {rank} read other bytes than rank {peer} shared"
            del flat
        except Exception as exc:
            reason = f"rank {rank} could not map rank {peer}'s buffer: {type(exc).__name__}: {exc}"
    reasons: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


TRANSPORTS: dict[str, type[Transport]] = {t.kind: t for t in (GlooTransport, NcclTransport, HostStagedTransport,
                                                              ShmTransport, CudaIpcTransport)}


def make_transport(kind: str, device: torch.device, group: Any = None) -> Transport:
    return TRANSPORTS[kind](device, group)
