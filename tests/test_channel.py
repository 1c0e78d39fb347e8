"""The control plane's hub over real loopback sockets: a peer that leaves is an error until it said its last word."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.pipeline.channel import ChannelError, Hub, connect


@pytest.fixture
def hub_and_ranks():
    hub = Hub("127.0.0.1")
    ranks: dict[int, object] = {}
    connecting = [threading.Thread(target=lambda r=r: ranks.__setitem__(r, connect("127.0.0.1", hub.port, r, 10)))
                  for r in (0, 1)]
    for t in connecting:
        t.start()
    hub.accept([0, 1], timeout=10)
    for t in connecting:
        t.join()
    yield hub, ranks
    for ch in ranks.values():
        ch.close()
    hub.close()


def poll_until(hub: Hub, want: int, timeout: float = 10) -> list[tuple[int, dict]]:
    got: list[tuple[int, dict]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += hub.poll(0.05)
    return got


def test_a_rank_that_closes_without_retiring_fails_the_poll_naming_it(hub_and_ranks) -> None:
    hub, ranks = hub_and_ranks
    ranks[1].close()
    with pytest.raises(ChannelError, match="rank 1 closed its control channel"):
        poll_until(hub, 1)


def test_a_retired_rank_may_leave_while_its_peers_still_talk(hub_and_ranks) -> None:
    hub, ranks = hub_and_ranks
    ranks[1].send({"op": "bye"})
    assert poll_until(hub, 1) == [(1, {"op": "bye"})]
    hub.retire(1)
    ranks[1].close()  # it exits before rank 0 has finished: no longer an error
    time.sleep(0.1)
    assert hub.poll(0.05) == []
    ranks[0].send({"op": "done", "step": 7})
    assert poll_until(hub, 1) == [(0, {"op": "done", "step": 7})]
    hub.send(0, {"op": "stop"})
    assert ranks[0].recv(5) == {"op": "stop"}
