"""The step record's clocks: host times on CPU; on CUDA, events recorded on the stream that
did the work and read one step later, without a CUDA synchronisation. No GPU here: torch.cuda's events and streams
are stood in for by a fake whose time advances by one second per record."""
from __future__ import annotations

import contextlib

import pytest
import torch

from overlap.base.step_record import Mark, StepKind
from overlap.runtime.timing import CudaClock, HostClock, StepLog


class FakeEvent:
    now = 0.0
    created = 0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        FakeEvent.created += 1
        self.time = None
        self.stream = None

    def record(self, stream=None) -> None:
        FakeEvent.now += 1.0
        self.time, self.stream = FakeEvent.now, stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.time - self.time) * 1e3          # milliseconds, as CUDA's


def _step(log: StepLog, clock: CudaClock) -> None:
    log.mark(Mark.PRE_FORWARD, "u")                                # compute stream, t = 1
    collective = log.collective("all_gather", "u", 10, "side")    # side stream, t = 2
    collective.end = clock.stamp("side")                          # t = 3
    collective.wait_start = clock.stamp()                          # compute stream, t = 4
    collective.wait_end = clock.stamp()                            # t = 5
    log.mark(Mark.POST_FORWARD, "u")                               # t = 6


def test_cuda_times_are_events_read_one_step_later(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    FakeEvent.now, FakeEvent.created, FakeEvent.synchronized = 0.0, 0, 0
    clock = CudaClock(torch.device("cuda", 0))
    log = StepLog(clock)
    waited = []
    records = []
    for step in (1, 2, 3):
        _step(log, clock)
        records.append(log.close(step, StepKind.FORWARD, None, {"u": 4}, 1, 0, lambda done: waited.append(done())))
    # Each close gives the step before's record, read without any wait (its events completed).
    assert records[0] is None
    assert FakeEvent.synchronized == 0 and waited == []
    for step, record in zip((1, 2), records[1:]):
        assert record.step == step and record.clock == "cuda"
        assert [e.time for e in record.events] == [0.0, 5.0]
        (collective,) = record.collectives
        assert (collective.start, collective.end, collective.wait) == (1.0, 2.0, (3.0, 4.0))
    # Steps 1 and 2 made their events (six stamps and the seal each); step 3 reused step 1's.
    assert FakeEvent.created == 14
    # Free again once read: step 2's events, on the streams where their work ran.
    assert [e.stream for e in clock._free] == ["compute", "side", "side", "compute", "compute", "compute", "compute"]


def test_cuda_times_wait_for_a_step_not_yet_complete(monkeypatch):
    """A step whose last event has not completed when the next step closes is waited for
    with the order check's wait, never with a CUDA synchronisation."""

    class Late(FakeEvent):
        complete = False

        def query(self) -> bool:
            return Late.complete

    monkeypatch.setattr(torch.cuda, "Event", Late)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    clock = CudaClock(torch.device("cuda", 0))
    log = StepLog(clock)
    Late.synchronized = 0
    _step(log, clock)
    assert log.close(1, StepKind.TRAIN, None, {"u": 4}, 1, 1, lambda done: pytest.fail("nothing to read")) is None
    _step(log, clock)
    waits = []

    def wait(done) -> None:
        waits.append(done())
        Late.complete = True

    record = log.close(2, StepKind.TRAIN, None, {"u": 4}, 1, 1, wait)
    assert waits == [False] and Late.synchronized == 0 and record.step == 1


def test_host_times_are_taken_as_they_happen():
    log = StepLog(HostClock())
    log.mark(Mark.PRE_FORWARD, "u")
    log.collective("reduce_scatter", "u", 10)
    log.mark(Mark.POST_FORWARD, "u")
    record = log.close(3, StepKind.TRAIN, "u", {"u": 4}, 1, 1, lambda done: pytest.fail("host clocks never wait"))
    (first, last), (entry,) = record.events, record.collectives
    assert record.clock == "host" and first.time <= entry.start <= last.time
    assert entry.end == entry.start and entry.wait is None          # never completed nor waited: no interval


def _records(rank: int, world: int, late: bool) -> dict:
    """Three training steps of a small ShardedModule; what `last_step` was after each step,
    the records the step-end callbacks were handed, and what a flush gave."""
    from overlap import ShardedModule
    from overlap.runtime.timing import records_one_step_late

    torch.manual_seed(0)
    with records_one_step_late() if late else contextlib.nullcontext():
        model = ShardedModule(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
                              bucket_mb=1e-6, prefetch_depth=1)     # a depth given: no re-planning
    handed = []
    model.scheduler.step_end_callbacks.append(lambda scheduler: handed.append(scheduler.last_step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    last = []
    for _ in range(3):
        model(torch.randn(4, 8) + rank).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        last.append(None if model.scheduler.last_step is None else model.scheduler.last_step.step)
    flushed = model.scheduler.steps.flush(model.scheduler.order)

    def shape(record) -> tuple:
        return (record.step, record.kind, record.clock, [(e.mark, e.unit) for e in record.events],
                [(c.kind, c.unit, c.nbytes) for c in record.collectives])

    return dict(last=last, handed=[shape(r) for r in handed], flushed=None if flushed is None else flushed.step,
                again=model.scheduler.steps.flush(model.scheduler.order))


@pytest.mark.timeout(200)
def test_late_host_clock_delivers_each_record_one_step_late_and_a_flush_gives_the_last():
    """The CUDA clock's delivery on CPU: the record of step k comes at step k+1's close, the
    flush gives the last one, and the records are those the host clock gives as they happen."""
    from distributed import run_distributed

    late = run_distributed(_records, 2, True, timeout=150)
    now = run_distributed(_records, 2, False, timeout=150)
    for late_rank, now_rank in zip(late, now):
        assert late_rank["last"] == [None, 1, 2] and late_rank["flushed"] == 3 and late_rank["again"] is None
        assert now_rank["last"] == [1, 2, 3] and now_rank["flushed"] is None
        assert late_rank["handed"] == now_rank["handed"] and [r[0] for r in now_rank["handed"]] == [1, 2, 3]
