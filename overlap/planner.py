"""Prefetch depth and bucket size for a link, before any step has been measured.

Per-link defaults come from the link's latency and bandwidth (see the README's table):
buckets are made large enough that a collective's fixed latency is a small share of its
transfer time, and slow links get one more unit of prefetch because a unit's all-gather
can take as long as its compute.
"""
from __future__ import annotations

from dataclasses import dataclass

# Latency (s) per collective and bandwidth (bytes/s) per rank, by link class.
LINK_DEFAULTS: dict[str, tuple[float, float]] = {
    "nvlink": (10e-6, 370e9),
    "infiniband": (30e-6, 46e9),
    "ethernet": (60e-6, 1.25e9),
    "loopback": (200e-6, 2.0e9),
}
# A collective's latency should be at most this share of its time.
LATENCY_SHARE = 0.10


@dataclass(frozen=True)
class Plan:
    prefetch_depth: int
    bucket_mb: float
    reason: str


def initial_plan(link: str) -> Plan:
    alpha, beta = LINK_DEFAULTS[link]
    # alpha <= share * (alpha + bytes / beta)  <=>  bytes >= alpha * beta * (1 - share) / share
    bucket_bytes = alpha * beta * (1 - LATENCY_SHARE) / LATENCY_SHARE
    depth = 1 if link == "nvlink" else 2
    return Plan(depth, bucket_bytes / 2**20,
                f"{link} alpha={alpha * 1e6:.0f}us beta={beta / 1e9:.1f}GB/s -> depth {depth}, "
                f"bucket {bucket_bytes / 2**20:.1f} MB")
