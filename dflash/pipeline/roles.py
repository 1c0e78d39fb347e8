"""Who each rank is: roles by rank, the device rule, and the world-size checks made before any model loads.

The first ``n_target`` ranks are targets (producers), the next ``n_drafter`` ranks are drafters; the
first drafter rank also hosts the coordinator thread. Each rank owns one device by one rule:
``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``. One GPU shared by every rank of a node is
the one exception the rule allows (NCCL refuses two ranks on one device, so the data plane then goes
over host memory with gloo); any other node with fewer GPUs than ranks is refused.

Torch-free: the caller passes the CUDA device count in, so the checks run (and fail) in the parent
before a process starts or torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.errors import ConfigError

TARGET = "target"
DRAFTER = "drafter"

# How the hidden states travel between ranks.
DATA_GLOO = "gloo"  # CPU tensors over gloo (every CPU run)
DATA_NCCL = "nccl"  # device to device over NCCL (one GPU per rank)
DATA_HOST = "host"  # one GPU shared by the node's ranks: staged through host memory, gloo between ranks
DATA_SHM = "shm"  # CPU ranks of one node: the producer's buffer is shared memory, only its handle travels
DATA_IPC = "cuda-ipc"  # ranks sharing one GPU: the producer's device buffer is opened by CUDA IPC

# A sharing plane upgrades a copying one for the pairs of ranks on one node (dflash.pipeline.planes: pairs
# across nodes copy); the copying one is its fallback (used where the sharing is refused: the ranks probe
# it together at start).
SHARING = {DATA_GLOO: DATA_SHM, DATA_HOST: DATA_IPC}
FALLBACK = {shared: copying for copying, shared in SHARING.items()}
CPU_DEFAULT_SHARING = True  # measured: benchmarks/transport.py (RESULTS.md, "data planes on the CPU")
PLANE_CHOICES = ("auto", DATA_GLOO, DATA_SHM, DATA_HOST, DATA_IPC, DATA_NCCL)

DEVICE_RULE = "each rank uses cuda:LOCAL_RANK when CUDA is available, else the CPU (set [cluster] n_target/n_drafter)"


@dataclass(frozen=True, slots=True)
class Roles:
    """One rank's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    n_target: int
    n_drafter: int

    @property
    def role(self) -> str:
        return TARGET if self.rank < self.n_target else DRAFTER

    @property
    def is_target(self) -> bool:
        return self.rank < self.n_target

    @property
    def worker(self) -> int:
        """Index among ranks of the same role (producer index or drafter index)."""
        return self.rank if self.is_target else self.rank - self.n_target

    @property
    def coordinator_rank(self) -> int:
        return self.n_target

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.n_target

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.n_target))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.n_target, self.n_target + self.n_drafter))


def check_world(n_target: int, n_drafter: int, world_size: int, *, what: str = "world size") -> None:
    """World size must be n_target + n_drafter: one line naming both."""
    if world_size != n_target + n_drafter:
        raise ConfigError("cluster.n_target + cluster.n_drafter",
                          f"must equal the {what} ({world_size}); the roles are n_target {n_target} + "
                          f"n_drafter {n_drafter} = {n_target + n_drafter}", show_got=False)


def data_plane(cuda_devices: int, local_world_size: int) -> str:
    """The data plane for a node: gloo on the CPU, NCCL with a GPU per rank, host staging on one shared GPU.

    Raises ConfigError for more CUDA ranks on a node than GPUs (other than the single shared GPU).
    """
    if cuda_devices <= 0:
        return DATA_GLOO
    if cuda_devices == 1 and local_world_size > 1:
        return DATA_HOST
    if local_world_size > cuda_devices:
        raise ConfigError("--nproc-per-node", f"at most the {cuda_devices} GPUs of this node per node ({DEVICE_RULE})",
                          local_world_size)
    return DATA_NCCL


def shares_gpu(plane: str) -> bool:
    """Do this job's target and drafter ranks take turns on one GPU? (the planes of one shared GPU). Its
    records say so (``shared_gpu``): each side's stage times then include the other's turns, and the
    pipeline's ideal is ``1 / (1/T + 1/D)``, not ``min(T, D)`` (docs/ARCHITECTURE.md)."""
    return plane in (DATA_HOST, DATA_IPC)


def choose_plane(placement: str, *, one_node: bool, requested: str = "auto") -> str:
    """The plane to try, given the placement's copying plane (:func:`data_plane`).

    ``auto``: the sharing plane for ranks on one node (``one_node``: the pair's two ranks; CPU ranks only when
    ``CPU_DEFAULT_SHARING``), else the placement's own. A requested plane must fit the placement
    (``DFLASH_DATA_PLANE``; ConfigError otherwise). The ranks still probe a sharing plane before using it.
    """
    if requested not in PLANE_CHOICES:
        raise ConfigError("DFLASH_DATA_PLANE", f"must be one of {', '.join(PLANE_CHOICES)}", requested)
    if requested == "auto":
        if one_node and placement in SHARING and (placement != DATA_GLOO or CPU_DEFAULT_SHARING):
            return SHARING[placement]
        return placement
    allowed = {placement} | ({SHARING[placement]} if one_node and placement in SHARING else set())
    if requested not in allowed:
        raise ConfigError("DFLASH_DATA_PLANE", f"must be one of {', '.join(sorted(allowed))} for this placement "
                          f"({'all ranks on one node' if one_node else 'ranks on several nodes'}, "
                          f"placement plane {placement})", requested)
    return requested


PLANE_SAYS = {
    DATA_GLOO: "hidden states are copied between ranks over gloo",
    DATA_SHM: "CPU ranks of one node share memory: only a handle travels per item (gloo)",
    DATA_NCCL: "hidden states go device to device over NCCL",
    DATA_HOST: "one GPU is shared by this node's ranks: hidden states go through host memory (gloo)",
    DATA_IPC: "one GPU is shared by this node's ranks: the drafter maps the producer's memory (CUDA IPC)",
}


def plane_line(plane: str, refused: str | None = None) -> str:
    """The run's one line about its data plane (with why sharing was refused, when it was)."""
    line = f"data plane: {plane} ({PLANE_SAYS[plane]})"
    return line + (f"; sharing was refused ({refused}), so this is the fallback" if refused else "")


def device_for(local_rank: int, cuda_devices: int) -> str:
    """The device rule: cuda:LOCAL_RANK (cuda:0 when one GPU is shared), else cpu."""
    if cuda_devices <= 0:
        return "cpu"
    return "cuda:0" if cuda_devices == 1 else f"cuda:{local_rank}"
