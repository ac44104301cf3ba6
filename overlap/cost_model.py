"""How long a training step takes, replayed from unit sizes, compute times and the link's α-β model.

The replay runs the step the way the scheduler does (the merge rule and the limit on reductions
in flight below are the runtime's own, defined here so that this arithmetic needs no runtime): compute runs units in order on one lane;
all-gathers and reduce-scatters queue on one communication lane in the order they are issued
(one process group runs its collectives in issue order). Forward prefetches the next `depth`
units at each unit's start, backward the same in reverse order, and a unit's reduce-scatter is
issued when its backward ends, with at most `MAX_REDUCES_IN_FLIGHT` outstanding. Prefetch
stops at the memory budget, as in the scheduler. The step time it predicts is compute plus
the communication it could not hide.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from overlap.topology import LinkModel

# Reduce-scatters in flight at once before the oldest is waited for: each holds a unit's
# full-size gradient, so an unbounded queue would hold the whole model's gradients. One has
# the next unit's whole backward to finish in; a second one in flight raised peak memory by
# 14 MiB (4%) on the benchmark model. The scheduler applies it, the replay below models it.
MAX_REDUCES_IN_FLIGHT = 1


def bucket_runs(nbytes: Sequence[int], bucket_bytes: Optional[int]) -> list[range]:
    """The merge rule, for built units and for modelled ones alike: consecutive units join
    while their bucket stays within `bucket_bytes` (None or 0: no merging). A unit larger
    than the bucket stays alone; units are never split. Returns each bucket's index range."""
    runs: list[range] = []
    total = 0
    for index, size in enumerate(nbytes):
        if bucket_bytes and runs and total + size <= bucket_bytes:
            runs[-1] = range(runs[-1].start, index + 1)
            total += size
        else:
            runs.append(range(index, index + 1))
            total = size
    return runs


def bucket_name(names: Sequence[str]) -> str:
    """'blocks.0..blocks.3' for a bucket of several units, the unit's name for one."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


@dataclass(frozen=True)
class UnitCost:
    """One unit (or bucket): `nbytes` as bucketing counts them (master dtype), bytes gathered
    and reduced (whole buffers, in their transfer dtypes), compute seconds per pass."""

    name: str
    nbytes: int
    gather_bytes: int
    reduce_bytes: int
    forward_s: float = 0.0
    backward_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    """What the cost model needs about one step. `root` is gathered at the start of forward
    and reduced at the end of backward; `other_s` is compute outside the units (embedding,
    head, loss), placed between forward and backward."""

    units: tuple[UnitCost, ...]
    world_size: int
    root: Optional[UnitCost] = None
    other_s: float = 0.0
    reshard_after_forward: bool = True

    @property
    def compute_s(self) -> float:
        return self.other_s + sum(u.forward_s + u.backward_s for u in self.units)


@dataclass(frozen=True)
class Span:
    lane: str          # compute | comm
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float
    peak_gathered_bytes: int
    timeline: tuple[Span, ...] = ()

    @property
    def exposed_s(self) -> float:
        return max(self.step_s - self.compute_s, 0.0)


def wire_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of an `nbytes` buffer."""
    return nbytes * (world_size - 1) / world_size


class _Replay:
    """One step on a compute lane and a first-in-first-out communication lane."""

    def __init__(self, link: LinkModel, world: int, budget: Optional[int]) -> None:
        self.link, self.world, self.budget = link, world, budget
        self.now = 0.0
        self.comm_free_at = 0.0
        self.comm_busy = 0.0
        self.ready: dict[int, float] = {}      # unit index -> gather completion
        self.held: dict[int, int] = {}          # unit index -> gathered bytes held
        self.peak = 0
        self.spans: list[Span] = []

    def collective(self, label: str, nbytes: int) -> float:
        if nbytes <= 0:
            return self.now
        start = max(self.now, self.comm_free_at)
        self.comm_free_at = start + self.link.time(wire_bytes(nbytes, self.world))
        self.comm_busy += self.comm_free_at - start
        self.spans.append(Span("comm", label, start, self.comm_free_at))
        return self.comm_free_at

    def gather(self, index: int, unit: UnitCost, prefetch: bool) -> bool:
        if index in self.held:
            return True
        if prefetch and self.budget is not None and sum(self.held.values()) + unit.gather_bytes > self.budget:
            return False
        self.held[index] = unit.gather_bytes
        self.peak = max(self.peak, sum(self.held.values()))
        self.ready[index] = self.collective(f"gather {unit.name}", unit.gather_bytes)
        return True

    def wait(self, until: float) -> None:
        self.now = max(self.now, until)

    def compute(self, label: str, seconds: float) -> None:
        if seconds > 0:
            self.spans.append(Span("compute", label, self.now, self.now + seconds))
        self.now += seconds

    def free(self, index: int) -> None:
        self.held.pop(index, None)


def _prefetch(replay: _Replay, units: Sequence[UnitCost], order: Sequence[int], position: int, depth: int) -> None:
    for index in order[position + 1:position + 1 + depth]:
        if not replay.gather(index, units[index], prefetch=True):
            break


def predict_step(profile: Profile, link: LinkModel, forward_depth: int, backward_depth: int,
                 memory_budget_bytes: Optional[int] = None) -> Prediction:
    """Step time, exposed communication and peak gathered bytes for one configuration."""
    units = profile.units
    replay = _Replay(link, profile.world_size, memory_budget_bytes)
    root_ready = replay.collective("gather root", profile.root.gather_bytes) if profile.root else 0.0
    forward = list(range(len(units)))
    _prefetch(replay, units, forward, -1, forward_depth)
    replay.wait(root_ready)
    for position, index in enumerate(forward):
        replay.gather(index, units[index], prefetch=False)
        _prefetch(replay, units, forward, position, forward_depth)
        replay.wait(replay.ready[index])
        replay.compute(f"forward {units[index].name}", units[index].forward_s)
        # The unit that ends forward stays gathered: backward needs it first (the scheduler
        # keeps it, as FSDP2 users do with reshard_after_forward=False on the last block).
        if profile.reshard_after_forward and position < len(forward) - 1:
            replay.free(index)
    backward = forward[::-1]
    _prefetch(replay, units, backward, -1, backward_depth)
    replay.compute("root", profile.other_s)
    reduces: list[float] = []
    for position, index in enumerate(backward):
        replay.gather(index, units[index], prefetch=False)
        _prefetch(replay, units, backward, position, backward_depth)
        replay.wait(replay.ready[index])
        replay.compute(f"backward {units[index].name}", units[index].backward_s)
        reduces.append(replay.collective(f"reduce {units[index].name}", units[index].reduce_bytes))
        replay.free(index)
        while len(reduces) > MAX_REDUCES_IN_FLIGHT:
            replay.wait(reduces.pop(0))
    if profile.root:
        reduces.append(replay.collective("reduce root", profile.root.reduce_bytes))
    replay.wait(max(reduces, default=0.0))
    root_bytes = profile.root.gather_bytes if profile.root else 0
    return Prediction(replay.now, profile.compute_s, replay.comm_busy, replay.peak + root_bytes,
                      tuple(replay.spans))
