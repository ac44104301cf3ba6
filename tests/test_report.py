"""The overlap report: its arithmetic on a hand-made step, then on the real runtime (2 gloo ranks)."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from overlap.observe.report import OverlapReport, StepStats, UnitStats, analyse_step, peak_gathered_bytes, segments
from overlap.base.step_record import Collective, Mark, StepKind, StepRecord, UnitEvent
from distributed import run_distributed

ROOT = "<root>"

# One step of a root and two units, times in seconds. u0 is prefetched in forward and
# gathered on demand in backward; u1 the other way round.
EVENTS = [
    ("gather", ROOT, -0.1),
    ("prefetch", "u0", -0.05),
    ("pre_forward", ROOT, 0.1),
    ("hit", "u0", 0.2),
    ("pre_forward", "u0", 0.3),
    ("post_forward", "u0", 1.3),
    ("free", "u0", 1.35),
    ("miss", "u1", 1.4),
    ("gather", "u1", 1.4),
    ("pre_forward", "u1", 1.6),
    ("post_forward", "u1", 2.6),
    ("free", "u1", 2.65),
    ("post_forward", ROOT, 2.8),
    ("prefetch", "u1", 2.8),
    ("pre_backward", ROOT, 2.9),
    ("hit", "u1", 3.0),
    ("pre_backward", "u1", 3.1),
    ("post_backward", "u1", 5.1),
    ("reduce", "u1", 5.12),
    ("free", "u1", 5.2),
    ("miss", "u0", 5.25),
    ("gather", "u0", 5.25),
    ("pre_backward", "u0", 5.5),
    ("post_backward", "u0", 7.5),
    ("reduce", "u0", 7.52),
    ("free", "u0", 7.6),
    ("post_backward", ROOT, 7.8),
    ("reduce", ROOT, 7.82),
    ("free", ROOT, 7.9),
    ("end_backward", "", 8.0),
]
COLLECTIVES = [
    # kind, unit, bytes, start (issue), end (completion), wait
    Collective("all_gather", ROOT, 100, -0.1, 0.05, (0.0, 0.05)),
    Collective("all_gather", "u0", 400, -0.05, 0.25, (0.25, 0.28)),
    Collective("all_gather", "u1", 400, 1.4, 1.55, (1.4, 1.55)),
    Collective("all_gather", "u1", 400, 2.8, 3.05, (3.02, 3.05)),
    Collective("reduce_scatter", "u1", 400, 5.12, 5.9, (7.95, 7.97)),
    Collective("all_gather", "u0", 400, 5.25, 5.45, (5.3, 5.45)),
    Collective("reduce_scatter", "u0", 400, 7.52, 7.99, (7.97, 7.99)),
    Collective("reduce_scatter", ROOT, 100, 7.82, 7.92, (7.99, 7.995)),
]
UNIT_BYTES = {ROOT: 200, "u0": 800, "u1": 800}


def _record(events=EVENTS, step: int = 7) -> StepRecord:
    return StepRecord(step, StepKind.TRAIN, "host", tuple(UnitEvent(Mark(m), u, t) for m, u, t in events),
                      tuple(COLLECTIVES), ROOT, UNIT_BYTES, forwards=1, backwards=1)


def test_step_arithmetic():
    stats = analyse_step(_record())
    assert stats.step == 7
    assert stats.span_s == pytest.approx(8.1)
    # Units: 1 s forward and 2 s backward each; the root keeps what lies between them once
    # the runtime's work and the waits are cut out: 0.1 + 0.05 + 0.15 in forward, 0.1 + 0.05
    # + 0.2 in backward.
    assert stats.compute_s == pytest.approx(6.65)
    assert stats.gather_wait_s == pytest.approx(0.41)
    assert stats.reduce_wait_s == pytest.approx(0.045)
    assert stats.runtime_s == pytest.approx(8.1 - 6.65 - 0.455)
    # In flight or waited on: [-0.1, 0.28] [1.4, 1.55] [2.8, 3.05] [5.12, 5.9] [7.52, 7.995];
    # under compute: 0.1 (root), 0.1 (root), 0.05 (root) + 0.4 (u0), 0.2 (root).
    assert stats.comm_s == pytest.approx(2.035)
    assert stats.hidden_s == pytest.approx(0.85)
    assert stats.exposed_s == pytest.approx(2.035 - 0.85)
    assert stats.hidden_fraction == pytest.approx(0.85 / 2.035)
    assert (stats.prefetches, stats.hits, stats.misses) == (2, 2, 2)
    assert stats.gathered_bytes == 1700 and stats.reduced_bytes == 900 and stats.bytes_moved == 2600
    assert stats.peak_gathered_bytes == 1000

    units = {u.unit: u for u in stats.units}
    assert list(units) == [ROOT, "u0", "u1"]
    u1 = units["u1"]
    assert (u1.forward_s, u1.backward_s) == (pytest.approx(1.0), pytest.approx(2.0))
    assert u1.gather_wait_s == pytest.approx(0.18) and u1.reduce_wait_s == pytest.approx(0.02)
    assert u1.comm_s == pytest.approx(0.15 + 0.25 + 0.78)
    assert u1.hidden_s == pytest.approx(0.0 + 0.1 + 0.45)
    assert units["u0"].hidden_s == pytest.approx(0.1 + 0.0 + 0.2)
    assert (u1.gathers, u1.hits, u1.misses, u1.bytes_moved) == (2, 1, 1, 1200)
    root = units[ROOT]
    assert root.forward_s == pytest.approx(0.3) and root.backward_s == pytest.approx(0.35)
    assert root.hidden_s == 0.0
    assert (root.gathers, root.hits, root.misses) == (1, 0, 0)


def test_bytes_before_compression_are_shown_when_they_differ():
    plain = OverlapReport([analyse_step(_record(step=s)) for s in (1, 2)])
    assert plain.mean_step().uncompressed_bytes == plain.mean_step().bytes_moved == 2600
    assert "before compression" not in plain.to_text()
    # The same step with every collective sending a quarter of its uncompressed bytes.
    quartered = tuple(replace(c, nbytes=c.nbytes // 4, uncompressed_nbytes=c.nbytes) for c in COLLECTIVES)
    compressed = OverlapReport([analyse_step(replace(_record(step=s), collectives=quartered)) for s in (1, 2)])
    assert compressed.mean_step().bytes_moved == 650 and compressed.mean_step().uncompressed_bytes == 2600
    assert f"moved {650 / 2**20:.2f} MB/step ({2600 / 2**20:.2f} MB before compression)" in compressed.to_text()


def test_segments_tile_the_step():
    parts = segments(_record())
    for before, after in zip(parts, parts[1:]):
        assert before.end <= after.start + 1e-12, (before, after)
    assert sum(s.end - s.start for s in parts) == pytest.approx(8.1)
    assert {s.kind for s in parts} == {"forward", "backward", "wait", "runtime"}


def test_unit_without_gradients_ends_where_the_next_backward_starts():
    events = [e for e in EVENTS if not (e[0] in ("post_backward", "reduce") and e[1] == "u1")]
    u1 = {u.unit: u for u in analyse_step(_record(events)).units}["u1"]
    assert u1.backward_s == pytest.approx(5.5 - 3.1 - 0.15)          # to u0's pre_backward, less u0's gather wait


def test_peak_counts_each_unit_once_until_freed():
    events = [("prefetch", "a", 0), ("prefetch", "b", 1), ("prefetch", "a", 2), ("free", "a", 3),
              ("gather", "c", 4), ("free", "b", 5), ("free", "c", 6)]

    def peak(unit_bytes):
        return peak_gathered_bytes(StepRecord(1, StepKind.TRAIN, "host", tuple(UnitEvent(Mark(m), u, t)
                                                                               for m, u, t in events),
                                              (), None, unit_bytes))

    assert peak({"a": 1, "b": 2, "c": 4}) == 6
    assert peak({"a": 8, "b": 2, "c": 4}) == 10


def test_record_times_shift_together():
    record = _record().shifted(-0.1)
    assert record.bounds() == (pytest.approx(0.0), pytest.approx(8.1))
    assert analyse_step(record).hidden_s == pytest.approx(0.85)


def _step(step: int, comm: float, hidden: float, exposed: float, units=()) -> StepStats:
    return StepStats(step, 2.0, 1.0, 0.1, comm, hidden, exposed, exposed, 0.0, 1, 1, 0, 10, 10, 20, tuple(units))


def test_summary_leaves_out_the_first_step():
    report = OverlapReport([_step(1, 9.0, 0.0, 9.0), _step(2, 1.31, 1.14, 0.17), _step(3, 1.31, 1.14, 0.17)])
    assert report.summary() == "communication 1.31 s/step, 87% hidden, exposed 0.17 s"
    assert OverlapReport([_step(1, 0.004, 0.001, 0.003)]).summary() == \
        "communication 4.0 ms/step, 25% hidden, exposed 3.0 ms"
    assert OverlapReport([]).summary() == "no step measured"


def test_per_unit_means_count_missing_steps_as_zero():
    a = UnitStats("a", forward_s=1.0, hits=2)
    report = OverlapReport([_step(1, 1, 1, 0, [a]), _step(2, 1, 1, 0, [a]), _step(3, 1, 1, 0)], warmup_steps=1)
    (unit,) = report.per_unit()
    assert unit.unit == "a" and unit.forward_s == pytest.approx(0.5) and unit.hits == pytest.approx(1.0)
    text = report.to_text()
    assert report.summary() in text and "a " in text


# ---- the real runtime ---------------------------------------------------------------------------

def _train_and_report(rank: int, world_size: int, prefetch_depth: int):
    import torch

    from overlap import ShardedModule
    from overlap.models import GPT, Block, GPTConfig
    from overlap.observe.report import OverlapMonitor

    torch.manual_seed(0)
    model = ShardedModule(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)),
                          unit_types=(Block,), bucket_mb=0.001, prefetch_depth=prefetch_depth)
    monitor = OverlapMonitor()
    records = []
    model.step_end.controllers.append(monitor)
    model.scheduler.step_end_callbacks.append(lambda s: records.append(s.last_step))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    walls = []
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 16), generator=generator)
        start = time.perf_counter()
        model(idx, idx).backward()
        walls.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():                     # an evaluation forward: a step, not in the report
            model(idx, idx)
    return monitor.report(), records, model.scheduler.root.name, walls


@pytest.mark.timeout(180)
def test_report_matches_the_runtime():
    results = run_distributed(_train_and_report, 2, 1, timeout=150)
    for report, records, root, walls in results:
        assert [(r.step, r.kind, r.forwards, r.backwards) for r in records] == [
            (step, kind, 1, int(kind is StepKind.TRAIN)) for step in range(1, 7)
            for kind in [StepKind.TRAIN if step % 2 else StepKind.FORWARD]]
        assert [s.step for s in report.steps] == [1, 3, 5]
        for stats, record, wall in zip(report.steps, records[::2], walls):
            # The step's span, read from the record, against the test's own clock around the
            # forward and backward: inside it, and most of it.
            assert 0.5 * wall <= stats.span_s <= wall + 1e-3, (stats.span_s, wall)
            unit_gathers = [c for c in record.collectives if c.kind == "all_gather" and c.unit != root]
            assert stats.hits + stats.misses == len(unit_gathers) >= 3
            assert 0 <= stats.hidden_s <= stats.comm_s
            waits = stats.gather_wait_s + stats.reduce_wait_s
            assert stats.exposed_s >= waits - 1e-9
            assert stats.compute_s > 0 and stats.peak_gathered_bytes > 0
            for unit in stats.units:
                assert 0 <= unit.hidden_s <= unit.comm_s
                assert unit.hits + unit.misses == (unit.gathers if unit.unit != root else 0)
                assert unit.unit == root or (unit.forward_s > 0 and unit.backward_s > 0)
        first, later = report.steps[0], report.steps[1:]
        assert first.misses == 3                          # no order learned yet: forward gathers on demand
        assert all(s.misses == 0 and s.hits > 0 for s in later)   # then depth 1 prefetches every unit
        assert report.summary().startswith("communication ")
