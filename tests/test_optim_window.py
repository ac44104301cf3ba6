"""The disk engine's read-ahead window (overlap/optim/window.py) against an engine that steps
the ordinary way: a gradient changed after backward (as a binding clip changes it) is stepped
from buckets read ahead, written behind the step, with the same state bit for bit; the step
itself reads and writes nothing; a state dict right after the step sees the new values; a
shard goes back to speculating once its gradient stays as backward left it; a window too
small for the state streams the rest; a failed write behind marks the state inconsistent; a
load drops what was read ahead."""
from __future__ import annotations

import errno
import time

import pytest
import torch

from overlap.optim.paged import Hyper, PagedAdamW, Segment

SIZES = [300, 170]


def _pair(tmp_path, window_bytes: int):
    """An engine with a window and a reference without one (no speculation), same masters."""
    masters = [torch.randn(n) for n in SIZES]
    engines = []
    for name, window in (("window", window_bytes), ("ref", 0)):
        (tmp_path / name).mkdir()
        engine = PagedAdamW(SIZES, directory=str(tmp_path / name), bucket_params=64, window_bytes=window)
        engine.load_masters(masters)
        engines.append(engine)
    return engines


def _segments(step: float) -> list[Segment]:
    hyper = Hyper(1e-2, (0.9, 0.95), 1e-8, 0.1, step)
    return [Segment(0, 0, SIZES[0], hyper), Segment(1, 0, SIZES[1], hyper)]


def _backward(engine, grads, segments, resident) -> None:
    """What the disk tier does as each shard's gradient is reduced."""
    for shard in (1, 0):
        engine.speculate(shard, grads[shard], segments, resident[shard], on_bucket=lambda b: None,
                         before_write=lambda: None, restored=lambda: None)


def _clipped_step(engine, ref, step: int, resident) -> None:
    """One step on both engines whose gradients change after backward, as a binding clip's do."""
    grads = [torch.randn(n) for n in SIZES]
    _backward(engine, grads, _segments(float(step)), resident)
    for g in grads:
        g.mul_(0.5)
    engine.step(grads, _segments(float(step)), resident)
    ref.step(grads, _segments(float(step)))


def _state(engine) -> list[torch.Tensor]:
    return [torch.cat([b[name] for b in engine.state_dict()["buckets"]]).clone()
            for name in ("master", "exp_avg", "exp_avg_sq")]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_changed_gradient_steps_from_the_window_and_writes_behind(tmp_path, monkeypatch):
    engine, ref = _pair(tmp_path, window_bytes=1 << 20)
    write = engine.file.write

    def slow_write(*args, **kwargs):
        time.sleep(0.01)                # a state dict that did not flush would read the old slots
        write(*args, **kwargs)
    monkeypatch.setattr(engine.file, "write", slow_write)
    try:
        resident = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        expected = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        for step in range(1, 6):
            clip = step <= 3                    # the gradient changes after backward in steps 1-3
            grads = [torch.randn(n) for n in SIZES]
            segments = _segments(float(step))
            _backward(engine, grads, segments, resident)
            engine._wait_worker()
            read = engine.window.read_bytes
            if clip:
                for g in grads:
                    g.mul_(0.5)
            engine.step(grads, segments, resident)
            ref.step(grads, segments, expected)
            # The state dict right after the step flushes the writes behind and sees the step.
            assert _equal(_state(engine), _state(ref)), step
            assert _equal(resident, expected), step
            if step == 1:
                assert (engine.recomputes, engine.read_aheads) == (2, 0)       # speculated, recomputed
            elif step in (2, 3, 4):
                # Read ahead during backward, stepped in memory, written behind: the step itself
                # read and wrote nothing.
                assert engine.read_aheads == 2 * (step - 1) and engine.last_step.io_bytes == 0, step
                assert engine.window.read_bytes - read == 0      # all read before the step
            else:
                # Step 4 found the gradients as backward left them: step 5 speculated again.
                assert engine.commits == 2 and engine.read_aheads == 6
        file_bytes = sum(b.nbytes for b in engine.buckets)
        assert engine.window.read_bytes == engine.window.written_bytes == 3 * file_bytes
    finally:
        engine.close()
        ref.close()


def test_a_window_smaller_than_the_state_streams_the_rest(tmp_path):
    engine, ref = _pair(tmp_path, window_bytes=0)
    engine.window.capacity = 3 * engine.buckets[0].nbytes
    try:
        resident = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        for step in range(1, 4):
            _clipped_step(engine, ref, step, resident)
            assert _equal(_state(engine), _state(ref)), step
        streamed = sum(2 * b.nbytes for b in engine.buckets) - 2 * engine.window.capacity
        assert engine.last_step.io_bytes == streamed and engine.window._allocated <= engine.window.capacity
    finally:
        engine.close()
        ref.close()


def test_a_failed_write_behind_marks_the_state_inconsistent(tmp_path, monkeypatch):
    engine, ref = _pair(tmp_path, window_bytes=1 << 20)
    try:
        resident = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        for step in (1, 2):
            grads = [torch.randn(n) for n in SIZES]
            _backward(engine, grads, _segments(float(step)), resident)
            engine._wait_worker()
            if step == 2:
                monkeypatch.setattr(engine.file, "write",
                                    lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
            grads[0].mul_(0.5)
            grads[1].mul_(0.5)
            engine.step(grads, _segments(float(step)), resident)
        with pytest.raises(RuntimeError, match="write behind the step failed"):
            engine.state_dict()
    finally:
        monkeypatch.undo()
        engine.close()
        ref.close()


def test_a_load_drops_the_buckets_read_ahead(tmp_path):
    """The first reduction reads every shard that reads ahead; a load before the step makes
    those reads stale, and the step reads the loaded state again."""
    engine, ref = _pair(tmp_path, window_bytes=1 << 20)
    try:
        resident = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        for step in (1, 2):
            _clipped_step(engine, ref, step, resident)
        grads = [torch.randn(n) for n in SIZES]
        engine.speculate(1, grads[1], _segments(3.0), resident[1], on_bucket=lambda b: None,
                         before_write=lambda: None, restored=lambda: None)
        assert all(engine.window.holds(k) for k in range(len(engine.buckets))), "shard 0 is read at shard 1's"
        masters = [torch.randn(n) for n in SIZES]
        engine.load_masters(masters)
        ref.load_masters(masters)
        assert not engine.window.held()
        _backward(engine, grads, _segments(3.0), resident)
        for g in grads:
            g.mul_(0.5)
        engine.step(grads, _segments(3.0), resident)
        ref.step(grads, _segments(3.0))
        assert _equal(_state(engine), _state(ref))
        assert engine.last_step.io_bytes == 0
    finally:
        engine.close()
        ref.close()
