"""Hybrid sharding on CUDA: the all-reduce across replicas runs on its own stream, after the
reduce-scatter it sums, and only the end of backward waits for it (see [Note: the
all-reduce stream] in overlap/runtime/collectives.py). No GPU here: streams and events are
stood in for by fakes that write down what each stream was asked to do, in order."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from overlap.base.rules import MAX_REDUCES_IN_FLIGHT
from overlap.runtime.grad_reduction import GradReduction
from overlap.runtime.issue import issue
from overlap.runtime.timing import HostClock, StepLog


def _fake_cuda(monkeypatch) -> tuple[list[tuple[str, str]], type]:
    ops: list[tuple[str, str]] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: "Stream") -> None:
            ops.append((self.name, f"waits for {other.name}"))

        def wait_event(self, event: "Event") -> None:
            ops.append((self.name, f"waits for the event on {event.stream}"))

    class Event:
        def record(self, stream: Stream) -> None:
            self.stream = stream.name

    current = [Stream("compute")]

    @contextlib.contextmanager
    def on(stream: Stream):
        previous, current[0] = current[0], stream
        yield
        current[0] = previous

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)

    def run(what: str):
        return lambda *_: ops.append((current[0].name, what))

    Stream.run = staticmethod(run)
    return ops, Stream


def test_all_reduce_is_queued_on_its_own_stream_after_the_reduce_scatter(monkeypatch):
    ops, Stream = _fake_cuda(monkeypatch)
    log = StepLog(HostClock())
    reduce_stream, all_reduce_stream = Stream("reduce_scatter"), Stream("all_reduce")
    with issue(log, torch.device("cuda", 0), "reduce_scatter", "u", 8, reduce_stream, None) as call:
        call.launch(Stream.run("reduce-scatter"))
        call.then_run(Stream.run("sum chunks"))
        call.then_collective("all_reduce", 4, Stream.run("all-reduce"), Stream.run("add into the shard gradient"),
                             keep=(), stream=all_reduce_stream)
    pending = call.pending
    assert ops == [("reduce_scatter", "waits for compute"), ("reduce_scatter", "reduce-scatter"),
                   ("reduce_scatter", "sum chunks"),
                   ("all_reduce", "waits for reduce_scatter"), ("all_reduce", "all-reduce"),
                   ("all_reduce", "add into the shard gradient")]
    assert [c.kind for c in log.collectives] == ["reduce_scatter", "all_reduce"]
    # Waiting for the reduce-scatter orders compute after it alone, not after the all-reduce.
    del ops[:]
    pending.wait()
    assert ops == [("compute", "waits for the event on reduce_scatter")]
    pending.follow_up.wait()
    assert ops[-1] == ("compute", "waits for the event on all_reduce")


def _reductions(use_streams: bool) -> tuple[list[str], list[str], list[int]]:
    """Reduce six units' gradients; what was waited for before the end of backward, and after,
    and how many all-reduces were in flight when each unit's reduction was issued."""
    waits: list[str] = []

    class FakePending:
        def __init__(self, name: str, follow_up: "FakePending | None" = None) -> None:
            self.record, self.follow_up = SimpleNamespace(unit=name), follow_up

        def wait(self) -> None:
            waits.append(self.record.unit)

    collectives = SimpleNamespace(
        use_streams=use_streams, log=SimpleNamespace(mark=lambda *_: None),
        reduce_scatter=lambda grad, shard, dtype, unit, home: FakePending(f"rs {unit}", FakePending(f"ar {unit}")))
    reduction = GradReduction(collectives)
    group = SimpleNamespace(grad_for_reduce=lambda: None, reduce_dtype=torch.float32, grad_shard=None,
                            place=SimpleNamespace(reduction_issued=lambda pending: None), collectives=collectives)
    all_reduces_in_flight = []
    for index in range(6):
        reduction.reduce(SimpleNamespace(name=f"u{index}"), group, None)
        # An all-reduce starts when its reduce-scatter completes, and ends when it is waited for.
        started = len([w for w in waits if w.startswith("rs")])
        all_reduces_in_flight.append(started - len([w for w in waits if w.startswith("ar")]))
    before = list(waits)
    reduction.wait_all()
    return before, waits[len(before):], all_reduces_in_flight


def test_cuda_waits_for_all_reduces_only_at_the_end_of_backward():
    before, after, in_flight = _reductions(use_streams=True)
    assert not [w for w in before if w.startswith("ar")]
    assert [w for w in after if w.startswith("ar")] == [f"ar u{i}" for i in range(6)]
    assert len([w for w in before if w.startswith("rs")]) == 6 - MAX_REDUCES_IN_FLIGHT
    assert in_flight == [max(0, i + 1 - MAX_REDUCES_IN_FLIGHT) for i in range(6)]


def test_gloo_keeps_bounding_all_reduces_in_flight():
    """On gloo no more than MAX_REDUCES_IN_FLIGHT all-reduces are ever outstanding, each waited
    in the order issued, and the rest at the end of backward."""
    before, after, in_flight = _reductions(use_streams=False)
    assert max(in_flight) == MAX_REDUCES_IN_FLIGHT
    assert [w for w in before + after if w.startswith("ar")] == [f"ar u{i}" for i in range(6)]
    assert [w for w in before if w.startswith("ar")] == [f"ar u{i}" for i in range(6 - 2 * MAX_REDUCES_IN_FLIGHT)]
