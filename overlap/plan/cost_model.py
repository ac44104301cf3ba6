"""How long a training step takes, replayed from unit sizes, compute times and the link's α-β model.

The replay runs the step the way the scheduler does (the merge rule and the limit on reductions
in flight are the runtime's own, from `overlap.base.rules`): compute runs units in order on one lane;
all-gathers and reduce-scatters queue on one communication lane in the order they are issued
(one process group runs its collectives in issue order). With two link levels
(`CommLayout`) each collective is priced on the link of the group it runs on, and the node's
link and the network each get a lane of their own: hybrid sharding's all-reduce across nodes
runs beside the next gathers inside the node. Forward prefetches the next `depth`
units at each unit's start, backward the same in reverse order, and a unit's reduce-scatter is
issued when its backward ends, with at most `MAX_REDUCES_IN_FLIGHT` outstanding. Prefetch
stops at the memory budget, as in the scheduler. The step time it predicts is compute plus
the communication it could not hide.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from overlap.base.rules import MAX_REDUCES_IN_FLIGHT

from overlap.plan.links import LinkModel

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


@dataclass(frozen=True)
class GroupLink:
    """The ranks of a process group and the link model fitted (or assumed) for it; `lane` is
    the wire it occupies ("node": inside a node, "network": across nodes)."""

    ranks: int
    link: LinkModel
    lane: str = "network"

    def time(self, nbytes: float, all_reduce: bool = False) -> float:
        """A ring all-gather or reduce-scatter of an `nbytes` buffer; an all-reduce moves twice that."""
        if self.ranks < 2 or nbytes <= 0:
            return 0.0
        return self.link.time((2 if all_reduce else 1) * wire_bytes(nbytes, self.ranks))


@dataclass(frozen=True)
class CommLayout:
    """Where each collective of a step runs: forward's all-gather, backward's re-gather (hpZ:
    inside the node), the gradients' reduce-scatter and, with replicas (hybrid sharding), the
    all-reduce of the reduced shard across them."""

    name: str
    gather: GroupLink
    regather: GroupLink
    reduce: GroupLink
    across: Optional[GroupLink] = None

    @staticmethod
    def single(link: LinkModel, ranks: int) -> "CommLayout":
        group = GroupLink(ranks, link)
        return CommLayout("full", group, group, group)


class _Replay:
    """One step on a compute lane and a first-in-first-out communication lane per wire."""

    def __init__(self, budget: Optional[int]) -> None:
        self.budget = budget
        self.now = 0.0
        self.lane_free_at: dict[str, float] = {}
        self.comm_busy = 0.0
        self.ready: dict[int, float] = {}      # unit index -> gather completion
        self.held: dict[int, int] = {}          # unit index -> gathered bytes held
        self.peak = 0
        self.spans: list[Span] = []

    def collective(self, label: str, nbytes: int, group: GroupLink, all_reduce: bool = False,
                   after: float = 0.0) -> float:
        """Issue a collective now (or once `after` has passed); returns when it completes."""
        seconds = group.time(nbytes, all_reduce)
        if seconds <= 0:
            return max(self.now, after)
        start = max(self.now, after, self.lane_free_at.get(group.lane, 0.0))
        end = self.lane_free_at[group.lane] = start + seconds
        self.comm_busy += seconds
        self.spans.append(Span("comm", label, start, end))
        return end

    def gather(self, index: int, unit: UnitCost, prefetch: bool, group: GroupLink) -> bool:
        if index in self.held:
            return True
        if prefetch and self.budget is not None and sum(self.held.values()) + unit.gather_bytes > self.budget:
            return False
        self.held[index] = unit.gather_bytes
        self.peak = max(self.peak, sum(self.held.values()))
        self.ready[index] = self.collective(f"gather {unit.name}", unit.gather_bytes, group)
        return True

    def wait(self, until: float) -> None:
        self.now = max(self.now, until)

    def compute(self, label: str, seconds: float) -> None:
        if seconds > 0:
            self.spans.append(Span("compute", label, self.now, self.now + seconds))
        self.now += seconds

    def free(self, index: int) -> None:
        self.held.pop(index, None)


def _prefetch(replay: _Replay, units: Sequence[UnitCost], order: Sequence[int], position: int, depth: int,
              group: GroupLink) -> None:
    for index in order[position + 1:position + 1 + depth]:
        if not replay.gather(index, units[index], prefetch=True, group=group):
            break


def _reduce(replay: _Replay, label: str, unit: UnitCost, layout: CommLayout) -> float:
    """A unit's gradient reduction; with replicas its all-reduce follows the reduce-scatter
    (on CUDA both run on one stream), and the reduction completes with it."""
    done = replay.collective(f"reduce {label}", unit.reduce_bytes, layout.reduce)
    if layout.across is None:
        return done
    shard = unit.reduce_bytes // max(layout.reduce.ranks, 1)
    return replay.collective(f"reduce {label} across", shard, layout.across, all_reduce=True, after=done)


def predict_step(profile: Profile, link: Union[LinkModel, CommLayout], forward_depth: int, backward_depth: int,
                 memory_budget_bytes: Optional[int] = None) -> Prediction:
    """Step time, exposed communication and peak gathered bytes for one configuration, on
    one link (every collective over `profile.world_size` ranks) or on a `CommLayout`."""
    layout = link if isinstance(link, CommLayout) else CommLayout.single(link, profile.world_size)
    units = profile.units
    replay = _Replay(memory_budget_bytes)
    root_ready = replay.collective("gather root", profile.root.gather_bytes, layout.gather) if profile.root else 0.0
    forward = list(range(len(units)))
    _prefetch(replay, units, forward, -1, forward_depth, layout.gather)
    replay.wait(root_ready)
    for position, index in enumerate(forward):
        replay.gather(index, units[index], prefetch=False, group=layout.gather)
        _prefetch(replay, units, forward, position, forward_depth, layout.gather)
        replay.wait(replay.ready[index])
        replay.compute(f"forward {units[index].name}", units[index].forward_s)
        # The unit that ends forward stays gathered: backward needs it first (the scheduler
        # keeps it, as FSDP2 users do with reshard_after_forward=False on the last block).
        if profile.reshard_after_forward and position < len(forward) - 1:
            replay.free(index)
    backward = forward[::-1]
    _prefetch(replay, units, backward, -1, backward_depth, layout.regather)
    replay.compute("root", profile.other_s)
    reduces: list[float] = []
    for position, index in enumerate(backward):
        replay.gather(index, units[index], prefetch=False, group=layout.regather)
        _prefetch(replay, units, backward, position, backward_depth, layout.regather)
        replay.wait(replay.ready[index])
        replay.compute(f"backward {units[index].name}", units[index].backward_s)
        reduces.append(_reduce(replay, units[index].name, units[index], layout))
        replay.free(index)
        while len(reduces) > MAX_REDUCES_IN_FLIGHT:
            replay.wait(reduces.pop(0))
    if profile.root:
        reduces.append(_reduce(replay, "root", profile.root, layout))
    replay.wait(max(reduces, default=0.0))
    root_bytes = profile.root.gather_bytes if profile.root else 0
    return Prediction(replay.now, profile.compute_s, replay.comm_busy, replay.peak + root_bytes,
                      tuple(replay.spans))
