"""The offload tiers in numbers: a rank's model-state bytes on its device, in host memory and
on disk, and the time offloading adds to a step, for `overlap estimate --offload` and
`overlap simulate --offload`.

Per trainable parameter a rank keeps, over N ranks, overlap's own layout (see [Note: how
overlap's own layout maps onto these categories] in plan/memory.py): the fp32 master shard
(4Ψ/N), its fp32 gradient shard (4Ψ/N) and the optimizer's moments (4Ψ/N each; Adam 2).

    offload   device                     host                               disk
    none      master + gradient + moments   0                               0
    cpu       e·Ψ/N (the shard to send)  master + gradient + moments        0
    disk      e·Ψ/N                      e·Ψ/N + gradient + B buffers       2 × (master + moments)

e is the gathered dtype's element size under mixed precision (the 16-bit copy of the shard
the all-gather sends, refreshed after each step); in fp32 the master shard itself is sent,
copied to the device a unit at a time inside the gathered buffers, so e = 0 here. The disk
tier's host also holds a 16-bit copy (e·Ψ/N): the one the parameters are views of and the
paged step writes, copied to the device bucket by bucket. B host buffers each hold one
bucket's master and moments: the disk pipeline reads bucket k+1 and
writes bucket k-1 while bucket k is stepped (B = 3). The state file holds two slots of each
bucket, the current state and the spare one a step taken during backward writes
(overlap/optim/state_file.py, [Note: two slots per bucket]), so the disk holds the master and
moments twice. Gathered units and activations stay on the device in every tier; callers add them.

Time per step and rank:
  copies  the gradient shard device -> host (4Ψ/N) and the updated shard host -> device
          (e·Ψ/N, 4Ψ/N in fp32), one copy per unit each way, over the host link; they can
          run under backward and the next forward.
  update  Ψ/N parameters at the CPU optimizer's rate (benchmarks/optim_step.py measures it).
  io      master and moments read and written once, bucket by bucket, through one drive;
          pipelined with the update, so the two cost max(io, update), not their sum.
`extra_s` counts the copies as exposed (nothing hidden), `floor_s` as fully hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from overlap.base.choices import OFFLOAD_CHOICES
from overlap.plan.links import TIER_LINK_DEFAULTS, LinkModel
from overlap.plan.memory import MASTER_BYTES, OPTIMIZER_MOMENTS, PRECISIONS, state_bytes

# Parameters whose master and moments fill one disk bucket (16.8M: 200 MB with Adam), and how
# many such buffers the pipeline keeps in host memory (read ahead, stepping, writing back).
DISK_BUCKET_PARAMS = 2**24
DISK_BUFFERS = 3
# Slots of each bucket in the state file: current and spare (optim/state_file.py SLOTS).
DISK_SLOTS = 2
# The CPU AdamW rate per rank before anything is measured: a rank with a few cores of a
# server socket moves ~30 GB/s, 28 bytes per update (fp32 gradients), about 1e9 parameters
# a second; on the 2-core development machine it is a third of that (docs/optim.md).
CPU_UPDATE_PARAMS_PER_S = 1e9


@dataclass(frozen=True)
class TierRates:
    """How fast state moves between the tiers and how fast the CPU steps it."""

    host: LinkModel = TIER_LINK_DEFAULTS["host"]
    disk: LinkModel = TIER_LINK_DEFAULTS["disk"]
    update_params_per_s: float = CPU_UPDATE_PARAMS_PER_S

    def __post_init__(self) -> None:
        if not self.update_params_per_s > 0:
            raise ValueError(f"update_params_per_s={self.update_params_per_s!r} is invalid; expected a number > 0")


def rates_with(host_gbps: float | None = None, disk_gbps: float | None = None,
               update_params_per_s: float | None = None) -> TierRates:
    """The default rates, each one given replacing its default's bandwidth (GB/s = 1e9 B/s)."""
    host, disk = TIER_LINK_DEFAULTS["host"], TIER_LINK_DEFAULTS["disk"]
    for name, value in (("host_gbps", host_gbps), ("disk_gbps", disk_gbps)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value!r} is invalid; expected a number > 0")
    return TierRates(
        host if host_gbps is None else LinkModel("host", host.alpha, host_gbps * 1e9, "override"),
        disk if disk_gbps is None else LinkModel("disk", disk.alpha, disk_gbps * 1e9, "override"),
        CPU_UPDATE_PARAMS_PER_S if update_params_per_s is None else update_params_per_s)


@dataclass(frozen=True)
class TierBytes:
    """Model-state bytes per rank in each tier."""

    device: float
    host: float
    disk: float


@dataclass(frozen=True)
class OffloadTime:
    """Seconds a step spends per rank on offload's own work."""

    copy_s: float
    update_s: float
    io_s: float

    @property
    def extra_s(self) -> float:
        """Nothing hidden but the IO under the update."""
        return self.copy_s + max(self.io_s, self.update_s)

    @property
    def floor_s(self) -> float:
        """The copies hidden under backward and forward as well."""
        return max(self.io_s, self.update_s)


def _check(offload: str, params: float, world: int, precision: str, optimizer: str) -> None:
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload={offload!r} is invalid; expected one of {', '.join(OFFLOAD_CHOICES)}")
    if not params > 0 or world < 1:
        raise ValueError(f"params={params!r} and world={world!r} must be > 0 and >= 1")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; expected one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; expected one of {', '.join(OPTIMIZER_MOMENTS)}")


def _sent_bytes(precision: str) -> int:
    """Bytes per parameter of the shard the all-gather sends, when it is not the master."""
    element = state_bytes(precision, "sgd").weights   # the gathered dtype's element size
    return int(element) if element < MASTER_BYTES else 0


def tier_bytes(offload: str, params: float, world: int, precision: str = "bf16", optimizer: str = "adamw",
               bucket_params: float = DISK_BUCKET_PARAMS, buffers: int = DISK_BUFFERS) -> TierBytes:
    """Model-state bytes per rank on the device, in host memory and on disk (module docstring)."""
    _check(offload, params, world, precision, optimizer)
    shard = params / world
    master = gradient = MASTER_BYTES * shard
    moments = OPTIMIZER_MOMENTS[optimizer] * MASTER_BYTES * shard
    if offload == "none":
        return TierBytes(master + gradient + moments, 0.0, 0.0)
    device = _sent_bytes(precision) * shard
    if offload == "cpu":
        return TierBytes(device, master + gradient + moments, 0.0)
    per_param = MASTER_BYTES * (1 + OPTIMIZER_MOMENTS[optimizer])
    staging = buffers * per_param * min(bucket_params, shard)
    return TierBytes(device, device + gradient + staging, DISK_SLOTS * (master + moments))


def offload_time(offload: str, params: float, world: int, precision: str = "bf16", optimizer: str = "adamw",
                 rates: TierRates = TierRates(), units: int = 1,
                 bucket_params: float = DISK_BUCKET_PARAMS) -> OffloadTime:
    """Per-rank seconds of copies, CPU update and disk IO in one step (module docstring);
    `units` copies each way per step (one per unit)."""
    _check(offload, params, world, precision, optimizer)
    if offload == "none":
        return OffloadTime(0.0, 0.0, 0.0)
    if units < 1:
        raise ValueError(f"units={units!r} is invalid; expected an integer >= 1")
    shard = params / world
    sent = (_sent_bytes(precision) or MASTER_BYTES) * shard
    gradient = MASTER_BYTES * shard
    copy_s = 2 * units * rates.host.alpha + (gradient + sent) / rates.host.beta
    update_s = shard / rates.update_params_per_s
    io_s = 0.0
    if offload == "disk":
        state = MASTER_BYTES * (1 + OPTIMIZER_MOMENTS[optimizer]) * shard
        requests = 2 * math.ceil(shard / bucket_params)
        io_s = requests * rates.disk.alpha + 2 * state / rates.disk.beta
    return OffloadTime(copy_s, update_s, io_s)
