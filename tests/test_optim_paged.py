"""The disk-paged AdamW engine (overlap/optim/paged.py) against torch.optim.AdamW.

Parameters of odd sizes in two groups (different lr and weight decay) are laid end to end in
two flat shards, cut into small buckets so that segments cross bucket edges, and stepped
several times with fresh random gradients; torch.optim.AdamW (foreach=False) steps the same
parameters one by one. Moments and parameters must agree to fp32 rounding (the kernel's
tolerance, tests/test_optim_adamw.py). Also: the 16-bit resident copy, parameters left
without a gradient, the buffer bound, the state dict round trip, and the errors.
"""
from __future__ import annotations

import errno
import os
import random

import pytest
import torch

from overlap.optim.paged import DEFAULT_BUCKET_PARAMS, DEFAULT_BUFFERS, Hyper, PagedAdamW, Segment
from overlap.optim.state_file import SLOTS, StateFileError, plan_buckets
from overlap.plan.offload import DISK_BUCKET_PARAMS, DISK_BUFFERS, DISK_SLOTS

SHAPES = ((37,), (13, 11), (1000,), (5, 7, 3), (257,), (33, 9))
STEPS = 4
PARAM_RTOL = 4 * STEPS * torch.finfo(torch.float32).eps
GROUPS = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0})


def _seed() -> int:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


def _layout():
    """Shard 0 holds the first three parameters, shard 1 the rest; group by p.dim() (nanoGPT)."""
    places, offset_by_shard = [], [0, 0]
    for i, shape in enumerate(SHAPES):
        shard = 0 if i < 3 else 1
        n = torch.Size(shape).numel()
        places.append((shard, offset_by_shard[shard], offset_by_shard[shard] + n, 0 if len(shape) >= 2 else 1))
        offset_by_shard[shard] += n
    return offset_by_shard, places


def _segments(places, steps, with_grad):
    return [Segment(shard, lo, hi, Hyper(GROUPS[g]["lr"], (0.9, 0.95), 1e-8, GROUPS[g]["weight_decay"],
                                         float(steps[i])))
            for i, (shard, lo, hi, g) in enumerate(places) if with_grad[i]]


def _torch_optimizer(params):
    groups = [{"params": [p for p, shape in zip(params, SHAPES) if (len(shape) >= 2) == (g == 0)], **GROUPS[g]}
              for g in range(2)]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _flat(places, shards, tensors):
    flats = [torch.empty(n) for n in shards]
    for (shard, lo, hi, _), t in zip(places, tensors):
        flats[shard][lo:hi] = t.reshape(-1)
    return flats


def _run_pair(tmp_path, *, grad_dtype=torch.float32, bucket_params=100, skip=()):
    seed = _seed()
    shards, places = _layout()
    params = [torch.randn(s) for s in SHAPES]
    engine = PagedAdamW(shards, directory=str(tmp_path), bucket_params=bucket_params)
    engine.load_masters(_flat(places, shards, params))
    reference = [p.clone() for p in params]
    optimizer = _torch_optimizer(reference)
    resident = [torch.empty(n, dtype=torch.bfloat16) for n in shards]
    steps = [0] * len(SHAPES)
    for step in range(STEPS):
        grads = [torch.randn(s).to(grad_dtype) for s in SHAPES]
        with_grad = [not (i in skip and step % 2 == 0) for i in range(len(SHAPES))]
        for i, (p, g) in enumerate(zip(reference, grads)):
            p.grad = g.float() if with_grad[i] else None
            steps[i] += with_grad[i]
        optimizer.step()
        flat_grads = [g.to(grad_dtype) for g in _flat(places, shards, [g.float() for g in grads])]
        engine.step(flat_grads, _segments(places, steps, with_grad), resident)
    return seed, engine, places, reference, optimizer, resident


def _engine_state(engine, places):
    """Per parameter: (master, exp_avg, exp_avg_sq) read through the state dict's file views."""
    sd = engine.state_dict()
    flats = {}
    for (shard, start, stop), bucket in zip(sd["layout"], sd["buckets"]):
        for name, value in bucket.items():
            flats.setdefault((shard, name), torch.zeros(engine.shard_sizes[shard]))[start:stop] = value
    return [tuple(flats[(shard, name)][lo:hi].clone() for name in ("master", "exp_avg", "exp_avg_sq"))
            for shard, lo, hi, _ in places]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_paged_step_matches_torch_adamw(tmp_path, grad_dtype):
    seed, engine, places, reference, optimizer, resident = _run_pair(tmp_path, grad_dtype=grad_dtype)
    try:
        assert len(engine.buckets) > 10, "the test must cross many bucket edges"
        for i, ((master, m, v), p) in enumerate(zip(_engine_state(engine, places), reference)):
            state = optimizer.state[p]
            torch.testing.assert_close(m, state["exp_avg"].reshape(-1), rtol=PARAM_RTOL, atol=1e-12,
                                       msg=lambda s: f"seed {seed}, param {i} exp_avg: {s}")
            torch.testing.assert_close(v, state["exp_avg_sq"].reshape(-1), rtol=PARAM_RTOL, atol=1e-12,
                                       msg=lambda s: f"seed {seed}, param {i} exp_avg_sq: {s}")
            torch.testing.assert_close(master, p.reshape(-1), rtol=PARAM_RTOL, atol=1e-7,
                                       msg=lambda s: f"seed {seed}, param {i} master: {s}")
            shard, lo, hi, _ = places[i]
            assert torch.equal(resident[shard][lo:hi], master.to(torch.bfloat16)), f"seed {seed}, param {i}"
        assert engine.peak_buffers == DEFAULT_BUFFERS
    finally:
        engine.close()
    assert not os.listdir(tmp_path), "close() must remove the state file"


def test_parameters_without_gradient_keep_their_state(tmp_path):
    seed, engine, places, reference, optimizer, _ = _run_pair(tmp_path, skip=(1, 4))
    try:
        for i, ((master, m, v), p) in enumerate(zip(_engine_state(engine, places), reference)):
            torch.testing.assert_close(master, p.reshape(-1), rtol=PARAM_RTOL, atol=1e-7,
                                       msg=lambda s: f"seed {seed}, param {i}: {s}")
            torch.testing.assert_close(m, optimizer.state[p]["exp_avg"].reshape(-1), rtol=PARAM_RTOL, atol=1e-12)
    finally:
        engine.close()


def test_defaults_are_the_planners():
    assert (DEFAULT_BUCKET_PARAMS, DEFAULT_BUFFERS, SLOTS) == (DISK_BUCKET_PARAMS, DISK_BUFFERS, DISK_SLOTS)


def test_buffers_bound_host_memory(tmp_path):
    engine = PagedAdamW([1000, 3001], directory=str(tmp_path), bucket_params=256)
    try:
        largest = max(b.nbytes for b in engine.buckets)
        assert engine.buffer_bytes == DEFAULT_BUFFERS * largest
        hyper = Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 1.0)
        engine.step([torch.randn(1000), torch.randn(3001)], [Segment(0, 0, 1000, hyper), Segment(1, 0, 3001, hyper)])
        assert engine.peak_buffers == DEFAULT_BUFFERS
        assert engine.last_step.io_bytes == 2 * sum(b.nbytes for b in engine.buckets)
    finally:
        engine.close()


def test_state_dict_round_trip(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    seed, a, places, *_ = _run_pair(tmp_path / "a")
    b = PagedAdamW(a.shard_sizes, directory=str(tmp_path / "b"), bucket_params=100)
    try:
        b.load_state_dict(a.state_dict())
        grads = [torch.randn(n) for n in a.shard_sizes]
        segments = _segments(places, [STEPS + 1] * len(SHAPES), [True] * len(SHAPES))
        outs = [[torch.empty(n) for n in a.shard_sizes] for _ in range(2)]
        for engine, out in zip((a, b), outs):
            engine.step(grads, segments, out)
        for x, y in zip(*outs):
            assert torch.equal(x, y), f"seed {seed}"
        with pytest.raises(ValueError, match="bucket_params must match"):
            PagedAdamW(a.shard_sizes, directory=str(tmp_path / "b"), bucket_params=64).load_state_dict(a.state_dict())
    finally:
        a.close()
        b.close()


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(StateFileError, match="does not exist.*OVERLAP_OFFLOAD_DIR"):
        PagedAdamW([10], directory=str(tmp_path / "nowhere"))


def test_default_directory_is_removed():
    engine = PagedAdamW([10])
    directory = engine.file.directory
    assert os.path.exists(engine.file.path)
    engine.close()
    assert not os.path.exists(directory)


def test_short_file_is_an_error_and_the_engine_refuses_to_go_on(tmp_path):
    engine = PagedAdamW([1000], directory=str(tmp_path), bucket_params=128)
    try:
        os.truncate(engine.file.path, engine.buckets[3].offset + 100)
        hyper = Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 1.0)
        with pytest.raises(StateFileError, match="shorter than its layout"):
            engine.step([torch.randn(1000)], [Segment(0, 0, 1000, hyper)])
        with pytest.raises(RuntimeError, match="inconsistent"):
            engine.step([torch.randn(1000)], [Segment(0, 0, 1000, hyper)])
    finally:
        engine.close()


def test_full_disk_at_creation_names_the_directory(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StateFileError, match="needs .* GiB in .* free; point OVERLAP_OFFLOAD_DIR"):
        PagedAdamW([1000], directory=str(tmp_path))
    assert not os.listdir(tmp_path)


def test_failed_write_is_an_error_and_marks_the_state(tmp_path, monkeypatch):
    engine = PagedAdamW([1000], directory=str(tmp_path), bucket_params=128)
    try:
        real, calls = os.pwritev, []

        def fails_third(fd, buffers, offset):
            calls.append(offset)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, buffers, offset)
        monkeypatch.setattr(os, "pwritev", fails_third)
        hyper = Hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 1.0)
        with pytest.raises(StateFileError, match="No space left"):
            engine.step([torch.randn(1000)], [Segment(0, 0, 1000, hyper)])
        monkeypatch.setattr(os, "pwritev", real)
        with pytest.raises(RuntimeError, match="inconsistent.*Load a checkpoint"):
            engine.step([torch.randn(1000)], [Segment(0, 0, 1000, hyper)])
        engine.load_state_dict({"layout": [(b.shard, b.start, b.stop) for b in engine.buckets],
                                "buckets": [{k: torch.zeros(b.numel) for k in ("master", "exp_avg", "exp_avg_sq")}
                                            for b in engine.buckets]})
        engine.step([torch.randn(1000)], [Segment(0, 0, 1000, hyper)])     # whole again
    finally:
        engine.close()


def test_bucket_plan_cuts_shards_in_order():
    buckets = plan_buckets([5, 0, 12], 4)
    assert [(b.shard, b.start, b.stop) for b in buckets] == [(0, 0, 4), (0, 4, 5), (2, 0, 4), (2, 4, 8), (2, 8, 12)]
    assert all(b.offset % 4096 == 0 for b in buckets)
    with pytest.raises(ValueError, match="bucket_params"):
        plan_buckets([5], 0)


def test_buckets_cut_on_parameter_boundaries():
    # shard 0: parameters of 3, 3, 9 and 2 elements; shard 1: one of 4
    buckets = plan_buckets([17, 4], 6, [[0, 3, 6, 15], [0]])
    assert [(b.shard, b.start, b.stop) for b in buckets] == [(0, 0, 6), (0, 6, 12), (0, 12, 15), (0, 15, 17),
                                                             (1, 0, 4)]
    assert all(b.numel <= 6 for b in buckets)
    assert [(b.start, b.stop) for b in plan_buckets([4], 6, [[0, 4, 4]])] == [(0, 4)]   # empty parts at the end
    with pytest.raises(ValueError, match="param_starts"):
        plan_buckets([4], 6, [[5]])


def test_parameters_map_to_one_contiguous_range(tmp_path):
    seed = _seed()
    shards, places = _layout()
    starts = [[lo for shard, lo, _, _ in places if shard == i] for i in range(len(shards))]
    engine = PagedAdamW(shards, directory=str(tmp_path), bucket_params=400, param_starts=starts)
    try:
        masters = [torch.randn(n) for n in shards]
        engine.load_masters(masters)
        for shard, lo, hi, _ in places:
            views = engine.map_range(shard, lo, hi)
            if hi - lo > 400:
                assert views is None, "a parameter longer than a bucket spans buckets"
                continue
            assert views is not None, f"seed {seed}: parameter at {shard}:{lo} spans buckets"
            assert torch.equal(views[0], masters[shard][lo:hi]) and torch.count_nonzero(views[1]) == 0
    finally:
        engine.close()


def test_offload_dir_setting():
    from overlap.base.config import config_from_env
    assert config_from_env({}).offload_dir is None
    assert config_from_env({"OVERLAP_OFFLOAD_DIR": " /data/state "}).offload_dir == "/data/state"
    with pytest.raises(ValueError, match="OVERLAP_OFFLOAD_DIR"):
        config_from_env({"OVERLAP_OFFLOAD_DIR": " "})


def test_new_file_reads_as_zeros_and_state_dict_views_follow_the_file(tmp_path):
    engine = PagedAdamW([700, 300], directory=str(tmp_path), bucket_params=128)
    try:
        views = engine.state_dict()
        assert all(torch.count_nonzero(t) == 0 for bucket in views["buckets"] for t in bucket.values())
        masters = [torch.randn(700), torch.randn(300)]
        engine.load_masters(masters)
        # views made before a write in place (direct IO where the file system has it) show it
        for (shard, start, stop), bucket in zip(views["layout"], views["buckets"]):
            assert torch.equal(bucket["master"], masters[shard][start:stop])
        hyper = Hyper(1e-2, (0.9, 0.999), 1e-8, 0.1, 1.0)
        engine.step([torch.randn(700), torch.randn(300)], [Segment(0, 0, 700, hyper), Segment(1, 0, 300, hyper)])
        after = [torch.empty(700), torch.empty(300)]
        engine.copy_masters_to(after)
        assert not torch.equal(after[0], masters[0])
        # a step writes the spare slots and makes them current: views made before it keep the
        # state before it (what an asynchronous save reads), the state dict after it is the step's
        stepped = engine.state_dict()
        for (shard, start, stop), bucket, new in zip(views["layout"], views["buckets"], stepped["buckets"]):
            assert torch.equal(bucket["master"], masters[shard][start:stop])
            assert torch.count_nonzero(bucket["exp_avg"]) == 0
            assert torch.equal(new["master"], after[shard][start:stop])
            assert torch.count_nonzero(new["exp_avg"]) > 0
    finally:
        engine.close()


def test_masters_load_from_a_function_one_bucket_at_a_time(tmp_path):
    _seed()
    masters = [torch.randn(900), torch.randn(50)]
    asked = []

    def slice_of(shard, start, stop):
        asked.append(stop - start)
        return masters[shard][start:stop].double()          # any float dtype; cast on the way in
    engine = PagedAdamW([900, 50], directory=str(tmp_path), bucket_params=256)
    try:
        engine.load_masters(slice_of)
        assert max(asked) <= 256 and sum(asked) == 950
        out = [torch.empty(900), torch.empty(50)]
        engine.copy_masters_to(out)
        assert all(torch.equal(o, m) for o, m in zip(out, masters))
        with pytest.raises(ValueError, match="returned 1 elements"):
            engine.load_masters(lambda shard, start, stop: torch.zeros(1))
        with pytest.raises(RuntimeError, match="inconsistent"):
            engine.copy_masters_to(out)
    finally:
        engine.close()


def test_file_size_limit_at_creation_is_a_clear_error(tmp_path):
    """A real refusal from the kernel (RLIMIT_FSIZE: EFBIG), not a mocked one."""
    import resource
    import signal
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        with pytest.raises(StateFileError, match="rank 0: cannot reserve space for the offload state file"):
            PagedAdamW([1 << 20], directory=str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not os.listdir(tmp_path)


def test_outputs_must_be_shard_sized_and_contiguous(tmp_path):
    engine = PagedAdamW([12], directory=str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"outputs\[0\] is not contiguous"):
            engine.copy_masters_to([torch.empty(4, 3).t()])
        with pytest.raises(ValueError, match=r"resident\[0\] is \(\(5,\), 'cpu'\); expected a CPU tensor of 12"):
            engine.step([torch.zeros(12)], [], [torch.empty(5)])
    finally:
        engine.close()


def test_shards_added_later_extend_the_file(tmp_path):
    _seed()
    engine = PagedAdamW([300], directory=str(tmp_path), bucket_params=128)
    try:
        index = engine.add_shard(500, [0, 200], bucket_params=300)
        assert index == 1 and engine.shard_sizes == (300, 500)
        assert [(b.shard, b.start, b.stop) for b in engine.buckets[-2:]] == [(1, 0, 200), (1, 200, 500)]
        assert os.path.getsize(engine.file.path) == engine.file.size == 2 * sum(b.nbytes for b in engine.buckets)
        assert engine.buffer_bytes == DEFAULT_BUFFERS * engine.buckets[-1].nbytes
        masters = [torch.randn(300), torch.randn(500)]
        engine.load_masters(masters)
        views = engine.map_range(1, 200, 500)
        assert torch.equal(views[0], masters[1][200:500])
    finally:
        engine.close()


def test_engines_sharing_a_directory_keep_their_own_files(tmp_path):
    first, second = (PagedAdamW([64], directory=str(tmp_path)) for _ in range(2))
    try:
        assert first.file.path != second.file.path
        first.load_masters([torch.ones(64)])
        second.load_masters([torch.full((64,), 2.0)])
        out = torch.empty(64)
        first.copy_masters_to([out])
        assert torch.equal(out, torch.ones(64))
    finally:
        first.close()
        second.close()
    assert not os.listdir(tmp_path)


# ---- two slots per bucket and the speculative step ---------------------------------------------

def _speculation_pair(tmp_path):
    """Two engines with the same masters (small buckets, two shards): one to speculate on, one
    stepped the ordinary way as the reference."""
    sizes = [300, 170]
    masters = [torch.randn(n) for n in sizes]
    engines = []
    for name in ("spec", "ref"):
        (tmp_path / name).mkdir()
        engine = PagedAdamW(sizes, directory=str(tmp_path / name), bucket_params=64)
        engine.load_masters(masters)
        engines.append(engine)
    return sizes, engines


def _hyper(step: float, lr: float = 1e-2) -> Hyper:
    return Hyper(lr, (0.9, 0.95), 1e-8, 0.1, step)


def _speculate(engine, shard, grad, segments, resident, calls):
    return engine.speculate(shard, grad, segments, resident, on_bucket=lambda b: calls.append(("bucket", b.shard)),
                            before_write=lambda: calls.append(("before",)), restored=lambda: calls.append(("restored",)))


def _state(engine) -> list[torch.Tensor]:
    return [torch.cat([b[name] for b in engine.state_dict()["buckets"]]).clone() for name in
            ("master", "exp_avg", "exp_avg_sq")]


def test_a_speculation_writes_the_spare_slots_and_a_step_that_agrees_commits_it(tmp_path):
    sizes, (spec, ref) = _speculation_pair(tmp_path)
    try:
        assert os.path.getsize(spec.file.path) == spec.file.size == 2 * sum(b.nbytes for b in spec.buckets)
        for step in (1.0, 2.0, 3.0):
            grads = [torch.randn(n) for n in sizes]
            segments = [Segment(0, 0, 120, _hyper(step)), Segment(0, 120, 300, _hyper(step, 3e-3)),
                        Segment(1, 0, 170, _hyper(step))]
            resident = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
            before, calls = _state(spec), []
            assert _speculate(spec, 0, grads[0], segments, resident[0], calls)
            assert not _speculate(spec, 0, grads[0], segments, resident[0], calls)   # one per shard
            spec.wait_speculation()
            assert all(torch.equal(x, y) for x, y in zip(before, _state(spec))), "the current slots are untouched"
            assert calls[0] == ("before",) and calls.count(("bucket", 0)) == 5 and torch.count_nonzero(resident[0])
            spec.step(grads, segments, resident)
            expected = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
            ref.step(grads, segments, expected)
            assert spec.commits == step and spec.recomputes == spec.restores == 0
            assert all(torch.equal(x, y) for x, y in zip(_state(spec), _state(ref))), step
            assert all(torch.equal(x, y) for x, y in zip(resident, expected)), step
        # Every step writes the spare slots and flips them: shard 0's three committed
        # speculations and shard 1's three plain steps each flipped every bucket three times.
        assert {spec.file.slot(b) for b in spec.buckets} == {1}
        # A state dict and maps show the current slots.
        first = spec.buckets[0]
        assert torch.equal(spec.map_range(0, first.start, first.stop)[1], spec.state_dict()["buckets"][0]["exp_avg"])
    finally:
        spec.close()
        ref.close()


@pytest.mark.parametrize("change", ["grad-scaled", "grad-replaced", "lr", "step", "segments", "failed"])
def test_a_speculation_whose_inputs_changed_is_recomputed(tmp_path, change, monkeypatch):
    sizes, (spec, ref) = _speculation_pair(tmp_path)
    try:
        grads = [torch.randn(n) for n in sizes]
        segments = [Segment(0, 0, 300, _hyper(1.0)), Segment(1, 0, 170, _hyper(1.0))]
        masters = [torch.empty(n) for n in sizes]
        spec.copy_masters_to(masters)
        resident, calls = [m.to(torch.bfloat16) for m in masters], []
        if change == "failed":
            real = spec.file.write
            monkeypatch.setattr(spec.file, "write", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
        _speculate(spec, 0, grads[0], segments, resident[0], calls)
        spec.wait_speculation()
        if change == "failed":
            monkeypatch.setattr(spec.file, "write", real)
        if change == "grad-scaled":
            grads[0].mul_(0.5)
        elif change == "grad-replaced":
            grads[0] = grads[0].clone()
        elif change in ("lr", "step"):
            segments[0] = Segment(0, 0, 300, _hyper(2.0) if change == "step" else _hyper(1.0, 5e-3))
        elif change == "segments":
            segments[0] = Segment(0, 0, 200, _hyper(1.0))
        spec.step(grads, segments, resident)
        expected = [m.to(torch.bfloat16) for m in masters]
        ref.step(grads, segments, expected)
        assert (spec.commits, spec.recomputes, spec.restores) == (0, 1, 0), change
        assert ("restored",) in calls
        assert all(torch.equal(x, y) for x, y in zip(_state(spec), _state(ref))), change
        # A bucket the speculation wrote and this step does not step is restored from the master.
        assert all(torch.equal(x, y) for x, y in zip(resident, expected)), change
    finally:
        spec.close()
        ref.close()


def test_a_dropped_speculation_restores_the_resident_copy_from_the_current_slot(tmp_path):
    sizes, (spec, ref) = _speculation_pair(tmp_path)
    try:
        masters = [torch.empty(n) for n in sizes]
        spec.copy_masters_to(masters)
        for settle in ("abandon", "step-without-it"):
            grads = [torch.randn(n) for n in sizes]
            segments = [Segment(0, 0, 300, _hyper(1.0)), Segment(1, 0, 170, _hyper(1.0))]
            resident, calls = [m.to(torch.bfloat16) for m in masters], []
            _speculate(spec, 0, grads[0], segments, resident[0], calls)
            spec.wait_speculation()
            assert not torch.equal(resident[0], masters[0].to(torch.bfloat16))
            if settle == "abandon":
                spec.abandon(0)
            else:
                spec.step(grads, segments[1:], resident)      # shard 0 not stepped at all
                ref.step(grads, segments[1:])
            assert calls[-1] == ("restored",) and not spec.speculating(0)
            assert torch.equal(resident[0], masters[0].to(torch.bfloat16)), settle
            assert all(torch.equal(x, y) for x, y in zip(_state(spec), _state(ref))), settle
        assert (spec.commits, spec.recomputes, spec.restores) == (0, 0, 2)
    finally:
        spec.close()
        ref.close()
