"""What moving an item's hidden states producer -> drafter costs, by where the two ranks sit.

The simulator charges every take ``bytes x seconds-per-byte`` of the pair that moved it, and a pair
is in one of three tiers (docs/ARCHITECTURE.md, "Transfers priced by placement"):

- ``device``: both ranks on one device (the CPU, or one GPU a node's ranks share): the producer
  packs the item into a shareable buffer and the drafter maps it (one copy inside device memory);
- ``node``: two devices of one node (NVLink or PCIe between GPUs);
- ``network``: two nodes (the NIC).

No tier is free unless the user says so. Each tier's rate is, in this order: the ``[timing]`` key
when set (by hand or by ``dflash calibrate`` from a real run that had such pairs), else the named
link of ``[cluster] device_link`` / ``node_link`` / ``network_link`` from :data:`LINKS`, whose figures
and sources are in docs/REFERENCE.md ("Links between ranks"). The figures are peaks in one direction:
a real move is slower, so an uncalibrated simulation errs on the cheap side.

Placement is the trainer's: ranks fill nodes of ``gpus_per_node`` in order, targets first, each target
worker on ``gpus_per_target`` GPUs (its first GPU sends) and each drafter on one; with
``shared_device`` every rank of a node sits on the node's one device, as the trainer places ranks on
the CPU or on a node with one GPU. Torch-free; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_DEVICE = "device"  # both ends on one device
TIER_NODE = "node"  # two devices of one node
TIER_NETWORK = "network"  # two nodes
TIERS = (TIER_DEVICE, TIER_NODE, TIER_NETWORK)

# The [timing] key that overrides each tier's link (and that a calibration writes).
TIER_KEYS = {TIER_DEVICE: "transfer_device_s_per_byte", TIER_NODE: "transfer_intra_s_per_byte",
             TIER_NETWORK: "transfer_inter_s_per_byte"}
# The [cluster] key that names each tier's link.
LINK_KEYS = {TIER_DEVICE: "device_link", TIER_NODE: "node_link", TIER_NETWORK: "network_link"}


@dataclass(frozen=True)
class Link:
    """One kind of link: the bytes per second one producer -> drafter move can reach over it."""

    name: str
    tier: str
    gb_per_s: float  # 1e9 bytes per second, one direction
    what: str  # the figure it comes from (docs/REFERENCE.md, "Links between ranks", gives the source)

    @property
    def s_per_byte(self) -> float:
        return 1.0 / (self.gb_per_s * 1e9)


LINKS: dict[str, Link] = {link.name: link for link in (
    Link("hbm3", TIER_DEVICE, 1675.0, "H100 SXM HBM3 3.35 TB/s; a copy reads and writes each byte"),
    Link("hbm3e", TIER_DEVICE, 2400.0, "H200 HBM3e 4.8 TB/s; a copy reads and writes each byte"),
    Link("cpu-shm", TIER_DEVICE, 1.851, "measured: the CPU profile's shm plane, 0.540 ns/byte (benchmarks/RESULTS.md)"),
    Link("nvlink4", TIER_NODE, 450.0, "NVLink 4 (H100/H200): 900 GB/s per GPU both directions"),
    Link("nvlink5", TIER_NODE, 900.0, "NVLink 5 (B200): 1.8 TB/s per GPU both directions"),
    Link("pcie4", TIER_NODE, 31.5, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b"),
    Link("pcie5", TIER_NODE, 63.0, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b"),
    Link("nic200", TIER_NETWORK, 25.0, "a 200 Gb/s NIC (NDR200 / 200GbE)"),
    Link("nic400", TIER_NETWORK, 50.0, "a 400 Gb/s NIC (NDR / 400GbE, one ConnectX-7 per GPU on HGX H100/H200)"),
)}
DEFAULT_LINKS = {TIER_DEVICE: "hbm3e", TIER_NODE: "nvlink4", TIER_NETWORK: "nic400"}  # an HGX H200 node


def links_of(tier: str) -> tuple[str, ...]:
    """The link names a tier's ``[cluster]`` key accepts."""
    return tuple(name for name, link in LINKS.items() if link.tier == tier)


@dataclass(frozen=True)
class TierRate:
    """One tier's price: seconds per byte and where it came from (``[timing] <key>`` or the link's name)."""

    tier: str
    s_per_byte: float
    origin: str

    def as_json(self) -> dict[str, object]:
        gbps = 1 / self.s_per_byte / 1e9 if self.s_per_byte > 0 else None
        return {"s_per_byte": self.s_per_byte, "gb_per_s": gbps, "from": self.origin}


def tier_rates(cluster: object, timing: object) -> dict[str, TierRate]:
    """Each tier's rate: the ``[timing]`` key when it is set, else the named link's (never free by default)."""
    out = {}
    for tier in TIERS:
        key = TIER_KEYS[tier]
        set_rate = getattr(timing, key)
        if set_rate is not None:
            out[tier] = TierRate(tier, float(set_rate), f"timing.{key}")
        else:
            link = LINKS[getattr(cluster, LINK_KEYS[tier])]
            out[tier] = TierRate(tier, link.s_per_byte, link.name)
    return out


def rank_slots(cluster: object) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(node, device) of each target worker's sending GPU and of each drafter, by the placement rule above."""
    c = cluster
    per_node = c.gpus_per_node  # type: ignore[attr-defined]

    def place(slot: int) -> tuple[int, int]:
        node = slot // per_node
        return (node, 0 if c.shared_device else slot)  # type: ignore[attr-defined]

    targets = [place(w * c.gpus_per_target) for w in range(c.n_target)]  # type: ignore[attr-defined]
    first = c.n_target * c.gpus_per_target  # type: ignore[attr-defined]
    drafters = [place(first + d) for d in range(c.n_drafter)]  # type: ignore[attr-defined]
    return targets, drafters


def pair_tier(a: tuple[int, int], b: tuple[int, int]) -> str:
    """The tier of a move between two (node, device) slots."""
    if a[0] != b[0]:
        return TIER_NETWORK
    return TIER_DEVICE if a[1] == b[1] else TIER_NODE


def pair_tiers(cluster: object) -> list[list[str]]:
    """``[producer][drafter]``: the tier every pair of the configured placement moves items over."""
    targets, drafters = rank_slots(cluster)
    return [[pair_tier(t, d) for d in drafters] for t in targets]


def transfer_s_per_byte(cluster: object, timing: object) -> list[list[float]]:
    """``[producer][drafter]``: seconds per byte of every pair (the simulator's transfer term)."""
    rates = tier_rates(cluster, timing)
    return [[rates[tier].s_per_byte for tier in row] for row in pair_tiers(cluster)]


__all__ = ["DEFAULT_LINKS", "LINKS", "LINK_KEYS", "TIERS", "TIER_DEVICE", "TIER_KEYS", "TIER_NETWORK", "TIER_NODE",
           "Link", "TierRate", "links_of", "pair_tier", "pair_tiers", "rank_slots", "tier_rates",
           "transfer_s_per_byte"]
