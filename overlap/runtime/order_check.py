"""Ranks that run different units get an error naming the step and the unit, not a hang.

[Note: checking that ranks run the same units]
Every gather and reduction is a collective that pairs with the same one on every other rank,
so every rank must run the same units in the same order. A rank that leaves the common order
(data-dependent control flow skips a block or calls one twice, runs another number of
forwards before backward, or is in `no_sync` alone) pairs its collectives with the wrong
ones: buffers of the same size exchange the wrong parameters silently, and buffers of
different sizes make gloo abort the process from its own thread (`gloo::EnforceNotMet`,
`terminate called`), so no error can reach the user after a mismatched collective is
issued. The check therefore runs before each one. Three ways were weighed:

- (i) Each rank knows when it leaves the order it learned (a prefetch miss, a unit at
  another position, a sync flag change), but its peers do not, and they go on issuing the
  collectives of the learned order: a local deviation cannot stop them without a message.
- (iii) Collectives padded to one size do not abort, but move the largest unit's bytes for
  every unit (the benchmark GPT's root, its embeddings, is 1.35 times a block) and still
  pair the wrong parameters silently.
- Only where sizes could differ: every step has gathers and reduce-scatters, and a gather
  paired with a reduce-scatter aborts as well, so every collective qualifies.
- (ii) An order word before each collective, chosen: two int64 (the step, and a CRC of the
  collective's kind, unit and bytes), all-reduced with their negations under MAX, so every
  rank gets the maximum and the minimum. The word has one size on every rank, so a mismatch
  shows on it, never on the data: where max != min, every rank of the same exchange sees it,
  swaps the units it ran and raises the same `DivergenceError`. It runs on a gloo group of
  its own over the same ranks (CPU tensors: no device sync on CUDA, and it does not queue
  behind the data collectives in the group's gloo threads). One word per unit boundary
  instead of per collective would save little: in the steady state each hook issues one
  collective (the benchmark GPT: 20 words a step, against 21 hooks: 7 units' forward,
  backward and gradient). The price is a round trip per collective, and that a rank ahead
  waits there for the others instead of at the wait. Measured on the benchmark GPT, two gloo
  ranks (benchmarks/order_check.py, docs/results/order_check.json): one exchange takes
  0.72 ms, 14 ms a step against a 1.3 s step (1.1 %); the paired per-round step ratio, with /
  without, has median 1.03 (0.88 to 1.32 over 5 rounds): below what the host's noise resolves.

[Note: order words only where ranks could part]
A word costs a host round trip per collective: on two gloo ranks sharing two cores it was a
quarter of `overlap train`'s step (docs/host_cost.md). Most steps repeat an earlier one, so
the words are exchanged only where a mismatch could happen. Each rank keeps the sequences of
collectives and step boundaries of earlier steps that the end-of-backward check verified alike
on every rank (its fingerprint covers the collectives too), at most a few (a training step, an
evaluation forward, ...). While this step's collectives so far are the beginning of a known
sequence, and no point has been passed where known sequences part, every rank that also
follows the known sequences issues the same collective: no word is needed. A rank that leaves
them, or passes a parting point (a training step and an evaluation forward share their
forward, then part), exchanges a word before each collective until a word matches again.
A rank that left alone waits in its word exchange while the others wait in their collective:
no mismatched collective is ever issued, and the blocked-wait check below finds the
difference; ranks that part at a point where sequences part all exchange words, and the word
says which. The first steps, a changed prefetch depth or a new kind of step run with words
until the end-of-backward check has verified them.

The words can be turned off (OVERLAP_ORDER_CHECK=step) where the round trip per collective
costs more than its safety is worth (many small units, a slow link's latency: see
docs/host_cost.md). Divergence is then still an error, from the two checks below, but later:
collectives of one size pair wrongly until the end of backward, where the check raises before
any gradient is published; collectives of different sizes make gloo abort the process, and on
NCCL the waiting ranks raise once the blocked-wait check finds the difference.

Two further checks remain for what the words do not see, and cost nothing beyond a few
integers while ranks agree:

- At the end of every backward that reduces, the small all-reduce that tells which
  parameters got a gradient on any rank (`Collectives.any_rank`) also carries each rank's
  step count and a fingerprint of the units it ran since the last check, as their maximum
  and their negated maximum (the minimum). Ranks that ran units in another order but issued
  the same collectives (a swap of two blocks whose prefetches happen to line up) all see it,
  exchange the units they ran and raise the same error.
- A rank blocked on a collective for `check_after_s` (10 s, or a quarter of the group's
  timeout when that is shorter) posts the units it ran to the group's store and compares
  them with rank 0's; a rank that finds a difference posts the verdict, and every waiting
  rank reads it and raises. Rank 0 raises last, once every rank has read it, since the store
  may live in its process. A rank that is only slow (writing a checkpoint) delays the others
  and nothing more: no error without a difference. This catches a peer stuck outside the
  collectives the words cover.
"""
from __future__ import annotations

import datetime
import itertools
import json
import logging
import pickle
import threading
import time
import zlib
from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from overlap.runtime.collective_sequence import CollectiveSequence
from overlap.runtime.process_group import device_backend

logger = logging.getLogger("overlap")

CHECK_AFTER_S = 10.0
# Store polls while blocked: from POLL_FIRST_S, doubling up to POLL_MAX_S.
POLL_FIRST_S = 0.05
POLL_MAX_S = 2.0
# Steps whose units are kept for the error message between two checks.
MAX_KEPT_STEPS = 64
# The fingerprint: a polynomial hash of the units run, modulo a Mersenne prime (fits int64).
_MODULUS = (1 << 61) - 1
_BASE = 1_000_003
END_FORWARD, END_BACKWARD, BEGIN_FORWARD = -1, -2, -3
# Ends each step's units, so that a rank that closed a step where another went on differs.
_END_STEP = -4
# A unit's code is 3 * index + one of these.
_FORWARD, _BACKWARD, _BACKWARD_UNSYNCED = 0, 1, 2
# ShardedModules built in this process: every rank builds them in the same order, so the
# count tells apart the store keys of two models over one group.
_instances = itertools.count()
# Every order-word group made, kept for the life of the process as torch keeps the groups
# `new_group` makes (until `destroy_process_group`): a gloo group destroyed on one rank while
# another still holds its end of the connection aborts that rank's process. A model's runtime
# is freed with the model, on each rank at its own moment; its words group must not be.
_word_groups: list[dist.ProcessGroup] = []


def _folded(fingerprint: int, value: int) -> int:
    return (fingerprint * _BASE + value + 4) % _MODULUS


# What usually makes ranks part, and what to do instead.
LIKELY_CAUSE = ("The likely cause is a forward run on some ranks only, such as an evaluation or a sample under "
                "`if rank == 0:` (or a data loader that gives some ranks more batches): run it on every rank "
                "(each on its own slice of the data, then all-reduce the loss), or build a plain copy of the model "
                "from model.full_state_dict(rank0_only=True), called on every rank, and run that on rank 0 alone")


class DivergenceError(RuntimeError):
    """Ranks ran different units: raised on every rank, naming the step and the unit."""


def _group_timeout_s(group: dist.ProcessGroup) -> float:
    try:
        device = torch.device("cuda" if device_backend(group, "cuda") == "nccl" else "cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; the check only shortens its deadline with it
        return 600.0


class OrderCheck:
    """The units this rank ran in each step since the last check, and the two checks above."""

    def __init__(self, group: dist.ProcessGroup, unit_names: Sequence[str], before_each_collective: bool = True) -> None:
        self.group = group
        # False (OVERLAP_ORDER_CHECK=step): no order words, the other two checks only.
        self.before_each_collective = before_each_collective
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.names = list(unit_names)
        self.check_after_s = min(CHECK_AFTER_S, _group_timeout_s(group) / 4)
        self._prefix = f"overlap/order/{next(_instances)}"
        self._kept: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=MAX_KEPT_STEPS)
        self._current: list[int] = []
        self._step = 0
        self._count = 0
        self._fingerprint = 0
        # The collectives since the last check, folded apart from the units: a rank may note a
        # unit's backward before or after issuing the previous unit's reduction (the order in
        # which autograd runs their hooks), which changes neither sequence.
        self._collectives = 0
        # Which collectives need a word. See [Note: order words only where ranks could part].
        self._sequence = CollectiveSequence()
        # The order words' own gloo group over the same ranks (see the note).
        timeout = datetime.timedelta(seconds=_group_timeout_s(group))
        self._words = dist.ProcessGroupGloo(dist.PrefixStore(f"{self._prefix}/words", group.get_group_store()),
                                            self.rank, self.world_size, timeout)
        _word_groups.append(self._words)
        # A rank can finish connecting a gloo group before the others have read its address
        # from the store: one exchange on it here keeps every rank in the constructor until all
        # are connected, so a rank that leaves soon after (an error in the user's code) does
        # not take the store down under a rank still connecting.
        self._words.allreduce([torch.zeros(1)]).wait()

    # ---- what ran ------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._step = step
        self._sequence.begin_step()

    def ran(self, unit_index: int, backward: bool, synced: bool = True) -> None:
        """A unit's forward or backward (`synced`: its gradients are reduced, not in no_sync)."""
        self._note(3 * unit_index + (_FORWARD if not backward else _BACKWARD if synced else _BACKWARD_UNSYNCED))

    def boundary(self, code: int) -> None:
        """BEGIN_FORWARD, END_FORWARD or END_BACKWARD."""
        self._note(code)
        self._sequence.add(code)

    def _note(self, code: int) -> None:
        self._current.append(code)
        self._count += 1
        self._fingerprint = _folded(self._fingerprint, code)

    def end_step(self) -> None:
        self._sequence.end_step()
        if self._current:
            self._note(_END_STEP)
            self._kept.append((self._step, tuple(self._current)))
        self._current = []

    def _traces(self) -> list[tuple[int, tuple[int, ...]]]:
        return list(self._kept) + ([(self._step, tuple(self._current))] if self._current else [])

    # ---- the check at the end of backward ----------------------------------------------------

    def words(self) -> list[int]:
        """What rides on the end-of-backward all-reduce (see the note)."""
        return [self._step, self._count, self._fingerprint, self._collectives]

    def verify(self, maxima: Sequence[int], minima: Sequence[int]) -> None:
        """Raise on every rank if any rank's words differed; else start a new check."""
        if list(maxima) != list(minima):
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, self._traces(), group=self.group)
            raise DivergenceError(self._message(everyone, complete=True) or
                                  "ShardedModule: ranks ran different units (no single difference found). "
                                  + LIKELY_CAUSE)
        self._kept.clear()
        self._current = []
        self._count = 0
        self._fingerprint = 0
        self._collectives = 0
        self._sequence.verified()

    # ---- the order word before each collective --------------------------------------------

    def before_issue(self, kind: str, unit: str, nbytes: int) -> None:
        """Exchange this rank's order word for the collective it is about to issue; raise
        DivergenceError on every rank if any rank is about to issue another (see the note).
        Nothing to exchange when the words are off, or where no rank could part from the
        others (see [Note: order words only where ranks could part])."""
        what = f"{kind} of {unit!r} ({nbytes} bytes)"
        code = zlib.crc32(what.encode())
        self._collectives = _folded(self._collectives, code)   # the end-of-backward check compares them too
        self._sequence.add(code)
        if not self.before_each_collective or self._sequence.follows:
            return
        word = [self._step, code]
        tensor = torch.tensor(word + [-w for w in word], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        work = self._words.allreduce([tensor], options)
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _future: finished.set())
        self.block(finished.is_set, finished.wait)
        try:
            work.wait()
        except RuntimeError:
            self.after_error()
            raise
        out = tensor.tolist()
        if out[:2] == [-v for v in out[2:]]:
            self._sequence.agreed()
            return
        everyone = self._all_gather((self._traces(), what))
        message = self._message([traces for traces, _ in everyone], complete=True)
        first = everyone[0][1]
        other = next(r for r, (_, theirs) in enumerate(everyone) if theirs != first or r == len(everyone) - 1)
        raise DivergenceError(
            (message or f"ShardedModule: ranks ran different units at step {self._step}. {LIKELY_CAUSE}") +
            f" (found before the {everyone[other][1]} on rank {other}, the {first} on rank 0)")

    def _all_gather(self, value: object) -> list:
        """`value` from every rank of the words group, in rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._words.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._words.allgather([received], [padded]).wait()
        return [pickle.loads(bytes(r[:int(n)].tolist())) for r, n in zip(received, sizes)]

    # ---- blocked waits -------------------------------------------------------------------------

    def block(self, done: Callable[[], bool], sleep: Callable[[float], bool]) -> None:
        """Return once `done()`; `sleep(seconds)` waits at most that long and returns `done()`.
        Past `check_after_s`, look for a difference between ranks (see the note)."""
        if done() or sleep(self.check_after_s):
            return
        logger.warning("rank %d: a collective at step %d has not completed after %.0f s; comparing the units "
                       "each rank ran", self.rank, self._step, self.check_after_s)
        interval = POLL_FIRST_S
        while not done():
            self.look_for_difference()
            if sleep(interval):
                return
            interval = min(2 * interval, POLL_MAX_S)

    def after_error(self) -> None:
        """A collective failed (a peer gave up or left): look for a difference for a while,
        so that a divergence is reported as one; returns when none is found."""
        deadline = time.monotonic() + self.check_after_s
        interval = POLL_FIRST_S
        while time.monotonic() < deadline:
            self.look_for_difference()
            time.sleep(interval)
            interval = min(2 * interval, POLL_MAX_S)

    def look_for_difference(self) -> None:
        """Post this rank's units, compare with rank 0's, read or post the verdict; raises
        DivergenceError when there is one. Store errors end the search quietly."""
        try:
            store = self.group.get_group_store()
            store.set(f"{self._prefix}/units/{self.rank}", json.dumps(self._traces()))
            verdict = self._read(store, "verdict")
            if verdict is None and self.rank != 0:
                theirs = self._read(store, "units/0")
                message = theirs and self._message([json.loads(theirs), self._traces()], complete=False, others=(
                    0, self.rank))
                if message:
                    verdict = store.compare_set(f"{self._prefix}/verdict", "", message).decode()
            if verdict is None:
                return
            read_by = store.add(f"{self._prefix}/read", 1)
            deadline = time.monotonic() + self.check_after_s
            while self.rank == 0 and read_by < self.world_size and time.monotonic() < deadline:
                time.sleep(POLL_FIRST_S)
                read_by = store.add(f"{self._prefix}/read", 0)
        except DivergenceError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is a best effort on a broken group
            logger.debug("order check: store unavailable (%s)", exc)
            return
        raise DivergenceError(verdict)

    def _read(self, store: dist.Store, key: str) -> Optional[str]:
        full = f"{self._prefix}/{key}"
        return store.get(full).decode() if store.check([full]) else None

    # ---- the message -------------------------------------------------------------------------

    def _describe(self, code: Optional[int]) -> str:
        if code is None:
            return "nothing more"
        if code == END_FORWARD:
            return "the end of forward"
        if code == END_BACKWARD:
            return "the end of backward"
        if code == BEGIN_FORWARD:
            return "the start of a forward"
        if code == _END_STEP:
            return "the end of the step"
        index, kind = divmod(code, 3)
        how = {_FORWARD: "forward", _BACKWARD: "backward", _BACKWARD_UNSYNCED: "backward under no_sync"}[kind]
        return f"unit {self.names[index]!r} ({how})"

    def _message(self, traces: list, complete: bool, others: Optional[tuple[int, ...]] = None) -> Optional[str]:
        """The first difference between rank 0's units and another rank's (`others` names
        the ranks of `traces` when they are not all ranks in order). Incomplete traces (of
        ranks still in a step, or posted at another time) are compared only over the steps
        both hold and only where both have a unit."""
        ranks = others or tuple(range(len(traces)))
        reference = {step: list(codes) for step, codes in traces[0]}
        for rank, trace in zip(ranks[1:], traces[1:]):
            mine = {step: list(codes) for step, codes in trace}
            steps = sorted(set(reference) | set(mine)) if complete else sorted(set(reference) & set(mine))
            for step in steps:
                theirs, ours = reference.get(step, []), mine.get(step, [])
                for position, (a, b) in enumerate(itertools.zip_longest(theirs, ours)):
                    if a == b:
                        continue
                    if (a is None or b is None) and not complete:
                        break
                    return (f"ShardedModule: ranks ran different units at step {step}: after {position} unit"
                            f"{'s' * (position != 1)} in the same order, rank {rank} ran {self._describe(b)} "
                            f"where rank {ranks[0]} ran {self._describe(a)}. Every rank must run the same units "
                            "in the same order: each gather and gradient reduction is a collective of all ranks. "
                            f"{LIKELY_CAUSE}")
        return None
