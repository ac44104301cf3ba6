"""The latency-bandwidth model of a link class, and each class's defaults before a probe.

A collective of `wire_bytes` per rank (what each rank sends: (N-1)/N of the gathered buffer
for a ring all-gather or reduce-scatter) takes `alpha + wire_bytes / beta`, NCCL's own cost
model folded to one latency and one bandwidth per link class.
"""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class LinkModel:
    """alpha: fixed time per collective (s); beta: bytes per second each rank moves."""

    link: str
    alpha: float
    beta: float
    source: str = "default"            # default | probe | cache

    def time(self, wire_bytes: float) -> float:
        return self.alpha + wire_bytes / self.beta

    def describe(self) -> str:
        return f"{self.link} α={self.alpha * 1e6:.0f}µs β={self.beta / 1e9:.2f}GB/s ({self.source})"


# Class defaults before any probe. NVLink and InfiniBand follow NCCL's figures for 8 GPUs:
# ~370 GB/s bus bandwidth on H100 NVLink, ~46 GB/s per NDR NIC, per-collective latency of a
# ring of 8 (base + 7 steps). Ethernet is a 10 Gbit/s NIC; loopback is gloo on one host, where
# the copy is CPU work (32 MB gathered in ~58 ms on the 2-core development machine). PCIe is
# GPUs of one host without NVLink: nccl-tests reach 35-45 GB/s all-reduce bus bandwidth on 8
# H100 PCIe (Gen5; Alaya NeW's NCCL-tests guide, 2026), and a Gen4 link carries half of
# Gen5's rate, so 20 GB/s, the slower common case; NCCL's cost model charges a PCIe ring step
# somewhat more latency than an NVLink one (hwLat in NCCL's tuning.cc), hence 20 µs.
LINK_DEFAULTS: dict[str, LinkModel] = {
    "nvlink": LinkModel("nvlink", 15e-6, 370e9),
    "pcie": LinkModel("pcie", 20e-6, 20e9),
    "infiniband": LinkModel("infiniband", 45e-6, 46e9),
    "ethernet": LinkModel("ethernet", 100e-6, 1.1e9),
    "loopback": LinkModel("loopback", 300e-6, 0.6e9),
}


# The links the offload tiers move state over, one direction's bandwidth each, before any
# measurement (overridable: OVERLAP_HOST_GBPS, OVERLAP_DISK_GBPS, or `overlap estimate`'s flags).
# host: device <-> pinned host memory over PCIe; a Gen4 x16 link carries ~25 GB/s of pinned
# copies each way in practice (Gen5 about twice that), and a copy costs ~10 µs to launch.
# disk: one local NVMe drive; a Gen4 data-centre drive sustains ~3 GB/s of large writes
# (reads are faster; the slower direction bounds a step that does both), ~100 µs a request.
# Reads and writes of one drive share its bandwidth.
TIER_LINK_DEFAULTS: dict[str, LinkModel] = {
    "host": LinkModel("host", 10e-6, 25e9),
    "disk": LinkModel("disk", 100e-6, 3e9),
}
