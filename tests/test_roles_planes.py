"""Which data plane a run tries: placement first, sharing where every rank is on one node, a fallback named.

Torch-free decisions (dflash.pipeline.roles): the CPU plane is gloo or shared memory, one shared GPU
is host staging or CUDA IPC, a GPU per rank is NCCL. A sharing plane is tried only with every rank on
one node (a handle means nothing on another machine); a requested plane that the placement cannot
use is one line naming DFLASH_DATA_PLANE.
"""

from __future__ import annotations

import pytest

from dflash.core.errors import ConfigError
from dflash.pipeline.roles import (
    CPU_DEFAULT_SHARING,
    DATA_GLOO,
    DATA_HOST,
    DATA_IPC,
    DATA_NCCL,
    DATA_SHM,
    FALLBACK,
    choose_plane,
    data_plane,
    plane_line,
)


def test_one_node_shares_memory_and_several_nodes_copy() -> None:
    one_gpu = data_plane(1, 2)
    assert choose_plane(one_gpu, one_node=True) == DATA_IPC
    assert choose_plane(one_gpu, one_node=False) == DATA_HOST
    assert choose_plane(data_plane(0, 3), one_node=True) == (DATA_SHM if CPU_DEFAULT_SHARING else DATA_GLOO)
    assert choose_plane(data_plane(0, 3), one_node=False) == DATA_GLOO
    assert choose_plane(data_plane(4, 4), one_node=True) == DATA_NCCL  # a GPU each: NCCL, nothing to share


def test_every_sharing_plane_falls_back_to_the_copying_plane_of_its_placement() -> None:
    assert FALLBACK == {DATA_SHM: DATA_GLOO, DATA_IPC: DATA_HOST}


@pytest.mark.parametrize(("placement", "one_node", "requested"), [
    (DATA_GLOO, True, DATA_GLOO), (DATA_GLOO, True, DATA_SHM), (DATA_HOST, True, DATA_HOST),
    (DATA_HOST, True, DATA_IPC), (DATA_NCCL, True, DATA_NCCL), (DATA_GLOO, False, DATA_GLOO)])
def test_a_requested_plane_the_placement_allows_is_used(placement: str, one_node: bool, requested: str) -> None:
    assert choose_plane(placement, one_node=one_node, requested=requested) == requested


@pytest.mark.parametrize(("placement", "one_node", "requested"), [
    (DATA_GLOO, True, DATA_IPC), (DATA_GLOO, False, DATA_SHM), (DATA_HOST, False, DATA_IPC),
    (DATA_NCCL, True, DATA_GLOO), (DATA_GLOO, True, "tcp")])
def test_a_plane_the_placement_cannot_use_is_one_line(placement: str, one_node: bool, requested: str) -> None:
    with pytest.raises(ConfigError) as info:
        choose_plane(placement, one_node=one_node, requested=requested)
    line = info.value.line()
    assert "DFLASH_DATA_PLANE" in line and requested in line and "\n" not in line


def test_the_run_names_its_plane_and_why_sharing_was_refused() -> None:
    assert plane_line(DATA_SHM).startswith("data plane: shm (")
    said = plane_line(DATA_GLOO, "rank 1: OSError: no /dev/shm")
    assert said.startswith("data plane: gloo") and "refused (rank 1: OSError: no /dev/shm)" in said
    assert "fallback" in said


def test_each_pair_gets_its_own_plane_sharing_only_within_a_node() -> None:
    """Several nodes: a pair on one node shares (shm, CUDA IPC), a pair across nodes copies; a refusal
    makes every within-node pair copy; NCCL has nothing to share. Both ends read one table."""
    from dflash.pipeline.planes import PlaneMap, RankPlace, plan
    from dflash.pipeline.roles import Roles

    roles = Roles(rank=0, world_size=4, local_rank=0, local_world_size=2, n_target=2, n_drafter=2)
    places = (RankPlace(0, 0, 0, "a"), RankPlace(1, 1, 0, "b"), RankPlace(2, 0, 1, "a"), RankPlace(3, 1, 1, "b"))
    cpu = plan(places, roles, DATA_SHM)
    assert cpu.planes == {(0, 2): DATA_SHM, (0, 3): DATA_GLOO, (1, 2): DATA_GLOO, (1, 3): DATA_SHM}
    assert cpu.plane(3, 1) == cpu.plane(1, 3) == DATA_SHM
    assert cpu.lines() == ["data plane shm for pairs 0->2 (node 0), 1->3 (node 1)",
                           "data plane gloo for pairs 0->3 (across nodes), 1->2 (across nodes)"]
    assert cpu.as_json()["ranks"]["3"] == {"node": 1, "local_rank": 1, "host": "b"}
    refused = plan(places, roles, DATA_SHM, refused="rank 2: no /dev/shm")
    assert set(refused.planes.values()) == {DATA_GLOO} and "refused (rank 2: no /dev/shm)" in refused.lines()[-1]
    gpu = plan(places, roles, DATA_IPC)
    assert gpu.planes[(0, 2)] == DATA_IPC and gpu.planes[(0, 3)] == DATA_HOST
    assert set(plan(places, roles, DATA_NCCL).planes.values()) == {DATA_NCCL}
    assert isinstance(cpu, PlaneMap)
