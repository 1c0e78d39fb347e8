"""The control plane's hub over real loopback sockets: a peer that leaves is an error until it said its last word."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.pipeline import messages as m
from dflash.pipeline.channel import _HEADER, ChannelError, Hub, LostRank, connect
from dflash.pipeline.transport import TensorMeta


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
    with pytest.raises(ChannelError, match="rank 1 closed its control channel") as e:
        poll_until(hub, 1)
    assert isinstance(e.value, LostRank) and e.value.rank == 1  # the coordinator tells a vanished rank by it


def test_a_retired_rank_may_leave_while_its_peers_still_talk(hub_and_ranks) -> None:
    hub, ranks = hub_and_ranks
    ranks[1].send(m.Bye())
    assert poll_until(hub, 1) == [(1, m.Bye())]
    hub.retire(1)
    ranks[1].close()  # it exits before rank 0 has finished: no longer an error
    time.sleep(0.1)
    assert hub.poll(0.05) == []
    done = m.Done(7, 123, (m.TakeReport(("0-1",), 0.5, 0.1, 64, 10, 1, 3, 9),), {"drafter_forward_s": 0.2}, None, [],
                  False, "node-a", "cpu")
    ranks[0].send(done)
    assert poll_until(hub, 1) == [(0, done)]
    hub.send(0, m.Stop())
    assert ranks[0].recv(5) == m.Stop()


def test_every_message_goes_through_the_wire_and_back_as_itself(hub_and_ranks) -> None:
    hub, ranks = hub_and_ranks
    meta = m.ItemMeta((TensorMeta((1, 8, 4), "torch.float32"),), "ab12")
    up = [m.NextItem(), m.Ready("0-3", 128, meta, 0.25, {"tokenize_s": 0.01}, 99, [{"power_w": 1.0}], "node-a", "cpu"),
          m.Closed(),
          m.Request(4), m.Bye(summary={"steps": 4}), m.Bye(send_s=0.5, sent_bytes=1024)]
    for msg in up:
        ranks[1].send(msg)
    assert [msg for _, msg in poll_until(hub, len(up))] == up
    down = [m.Admit("0-4"), m.Admit(None), m.Send(3, "0-3", 1), m.Assign(4, (m.Incoming(3, "0-3", 0, meta),)),
            m.NoWork(None)]
    for msg in down:
        hub.send(1, msg)
    assert [ranks[1].recv(5) for _ in down] == down


def _send_raw(ch, wire) -> None:
    import pickle

    data = pickle.dumps(wire)
    ch.sock.sendall(_HEADER.pack(len(data)) + data)


@pytest.mark.parametrize(("wire", "says"), [
    (("Gossip", {}), "unknown control message 'Gossip' from rank 1"),
    (("Request", {}), "malformed control message Request from rank 1: missing step"),
    (("Request", {"step": 1, "extra": 2}), "malformed control message Request from rank 1: unexpected extra"),
    (("Request", {"step": "one"}), "malformed control message Request from rank 1: step = 'one' is not int"),
    (("Assign", {"step": 1, "transfers": ()}), "control message Assign from rank 1 goes the other way"),
    ({"op": "request", "step": 1}, "malformed control message from rank 1"),
])
def test_an_unknown_or_malformed_message_is_an_error_naming_its_sender(hub_and_ranks, wire, says) -> None:
    hub, ranks = hub_and_ranks
    _send_raw(ranks[1], wire)
    with pytest.raises(m.ProtocolError, match=says.replace("(", r"\(")):
        poll_until(hub, 1)


def test_a_nested_part_of_the_wrong_shape_is_malformed_too(hub_and_ranks) -> None:
    hub, ranks = hub_and_ranks
    bad = m.Assign(2, (m.Incoming(1, "0-1", 0, m.ItemMeta(((1, 2),), None)),))  # a shape where a TensorMeta goes
    hub.send(1, bad)
    with pytest.raises(m.ProtocolError, match="malformed control message Assign from the coordinator: transfers"):
        ranks[1].recv(5)


def test_the_architecture_table_lists_every_message_with_its_fields() -> None:
    """docs/ARCHITECTURE.md ("Control messages") names each message as the code declares it."""
    import dataclasses
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs/ARCHITECTURE.md").read_text()
    for cls in (*m.TO_COORDINATOR, *m.TO_RANK):
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        assert f"| `{cls.__name__}({fields})` |" in doc, cls.__name__
