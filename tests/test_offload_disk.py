"""offload="disk" trains as offload="none" does with the same mixed precision and
overlap.optim.AdamW: the same model, batches and optimizer run both ways in one launch, at
world sizes 1-3, with no_sync, clipping, nanoGPT's weight-decay groups, hybrid sharding and
hpZ.

Both runs gather the same bf16 values (the disk tier's 16-bit shard is the master rounded as
the gather would round it), reduce the same fp32 gradients and step the same fp32 masters
with the same kernel and scalars (per parameter without offload, per segment of a bucket
with it), so losses (and an evaluation forward's after every step), clip norms and the
final fp32 masters (read back from the state file by `full_state_dict`) are compared bit
for bit. Also: the parameters are 16-bit views of the
resident shard with fp32 `.grad`, the settings that cannot work are refused on every rank,
and another optimizer stepping the parameters is an error, not a silent divergence.
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

from killed_resume import check_killed_run_resumes
from distributed import CaseLaunch, RankCase
from parity import Case, train, token_batches
from parity_cases import SMALL_GPT, _lm_loss

from overlap import MixedPrecision
from overlap.models import GPT, GPTConfig

STEPS = 3
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture(autouse=True)
def _state_files_in_tmp_path(tmp_path, monkeypatch):
    """The ranks' state files go to the test's directory (the launched ranks leave through
    os._exit, so nothing removes a temporary directory of their own)."""
    monkeypatch.setenv("OVERLAP_OFFLOAD_DIR", str(tmp_path))


def _case(wrap: dict, micro_batches: int, clip: float | None, optimizer: str = "overlap_adamw_dim_groups") -> Case:
    return Case("offload-disk", lambda: GPT(SMALL_GPT), _lm_loss, token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS),
                optimizer=optimizer, wrap=wrap, micro_batches=micro_batches, clip=clip, eval_every_step=True)


def _both(rank: int, world: int, wrap: dict, micro_batches: int, clip: float | None,
          local_world_size: int | None) -> dict:
    import os

    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor

    from overlap.optim.paged import paged_of

    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    seen = {}

    def inspect(model) -> None:
        groups = [g for unit in model.scheduler.all_units for g in unit.groups]
        params = list(model.parameters())
        seen["paged"] = all(paged_of(p) is not None for p in params)
        seen["dtypes"] = {str(p.dtype) for p in params} | {str(g.shard.dtype) for g in groups}
        seen["grad_dtypes"] = {str(p.grad.dtype) for p in params if p.grad is not None}
        engine = paged_of(params[0]).engine
        seen["peak_buffers"], seen["buffers"] = engine.peak_buffers, len(engine._buffers)
        # The sharded state dict (checkpoints) holds the fp32 masters, read from the state file.
        seen["state_dict_dtypes"] = {str(v.to_local().dtype) for v in model.state_dict().values()
                                     if isinstance(v, DTensor)}
        seen["views_of_shard"] = all(p.numel() == 0 or any(
            g.shard.data_ptr() <= p.data_ptr() < g.shard.data_ptr() + g.shard.nbytes for g in groups) for p in params)

    out = {}
    for tier in ("none", "disk"):
        torch._dynamo.reset()               # with compile=True: each run's own graphs counted
        counters.clear()
        out[tier] = train(_case({**wrap, "offload": tier}, micro_batches, clip), rank, world, sharded=True,
                          after=inspect if tier == "disk" else None)
        out[tier]["graphs"] = counters["stats"]["unique_graphs"]
    out["disk"].update(seen)
    return out


CASES = [
    # (id, world, wrap, micro-batches, clip, LOCAL_WORLD_SIZE)
    ("w1", 1, {"mixed_precision": BF16}, 1, None, None),
    ("w2-no_sync-clip", 2, {"mixed_precision": BF16}, 2, 0.05, None),
    ("w3-clip", 3, {"mixed_precision": BF16}, 1, 0.05, None),
    ("w2-hybrid", 2, {"mixed_precision": BF16, "sharding": "hybrid"}, 1, None, 1),
    ("w2-hpz-clip", 2, {"mixed_precision": BF16, "sharding": "hpz"}, 1, 0.05, 1),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,world", [c[:2] for c in CASES], ids=[c[0] for c in CASES])
def test_disk_offload_trains_as_without(name: str, world: int, launches: dict) -> None:
    per_rank = [outcome.result() for outcome in launches[world][f"train-{name}"]]
    for rank, result in enumerate(per_rank):
        ref, got = result["none"], result["disk"]
        assert got["paged"] and got["views_of_shard"], rank
        assert got["dtypes"] == {"torch.bfloat16"} and got["grad_dtypes"] <= {"torch.float32"}, rank
        assert 1 <= got["peak_buffers"] <= got["buffers"] == 3, rank
        assert got["state_dict_dtypes"] == {"torch.float32"}, rank
        assert all(torch.isfinite(torch.tensor(got["losses"]))), got["losses"]
        assert got["losses"] == ref["losses"], (rank, got["losses"], ref["losses"])
        assert got["eval_losses"] == ref["eval_losses"] and len(got["eval_losses"]) == STEPS, rank
        assert got["norms"] == ref["norms"], (rank, got["norms"], ref["norms"])
        for key, value in ref["state"].items():
            assert got["state"][key].dtype == value.dtype and torch.equal(got["state"][key], value), (rank, key)
    assert per_rank[0]["none"]["losses"][0] != per_rank[0]["none"]["losses"][-1]


@pytest.mark.slow          # a launch of its own, compiling each unit twice (about 15 s): in `make test-all`
@pytest.mark.timeout(900)
def test_disk_offload_with_compiled_units_trains_as_without(tmp_path) -> None:
    """compile=True, no_sync micro-batches and a clip: the disk tier's step during backward
    beside compiled units, bit for bit as offload="none" with the same compiled units."""
    launch = CaseLaunch({"compiled": RankCase(_both, ({"mixed_precision": BF16, "compile": True}, 2, 0.05, None))},
                        world_size=2,
                        env={"OVERLAP_OFFLOAD_DIR": str(tmp_path)}, timeout=800)
    for rank, outcome in enumerate(launch["compiled"]):
        result = outcome.result()
        ref, got = result["none"], result["disk"]
        assert ref["graphs"] >= 1 and got["graphs"] >= 1, (ref["graphs"], got["graphs"])
        assert got["paged"] and got["dtypes"] == {"torch.bfloat16"}, rank
        assert all(math.isfinite(loss) for loss in got["losses"]), got["losses"]
        assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"], (rank, got, ref)
        for key, value in ref["state"].items():
            assert torch.equal(got["state"][key], value), (rank, key)


def _device_copy(rank: int, world: int) -> list[dict]:
    import overlap.runtime.disk_tier as disk_tier

    saved = disk_tier.DEFAULT_BUCKET_PARAMS, disk_tier.SEPARATE_COPY_WITHOUT_DEVICE
    # Buckets no larger than a parameter's part, so that a shard is stepped (and copied to the
    # device) in several buckets.
    disk_tier.DEFAULT_BUCKET_PARAMS = 1
    # A device copy of its own, as on CUDA (on CPU the tier sends the host shard itself).
    disk_tier.SEPARATE_COPY_WITHOUT_DEVICE = True
    try:
        return _device_copy_steps(rank, world)
    finally:
        disk_tier.DEFAULT_BUCKET_PARAMS, disk_tier.SEPARATE_COPY_WITHOUT_DEVICE = saved


def _device_copy_steps(rank: int, world: int) -> list[dict]:
    from overlap import ShardedModule
    from overlap.optim import AdamW
    from overlap.optim.paged import paged_of

    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    groups = [g for unit in model.scheduler.all_units for g in unit.groups if g.place.offloaded]
    engine = paged_of(next(model.parameters())).engine
    opt = AdamW(model.parameters(), lr=1e-2)
    records = []
    for batch in token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)():
        before, commits = [g.place.uploads for g in groups], engine.commits
        loss = _lm_loss(model, (batch[0][rank::world], batch[1][rank::world]))
        loss.backward()
        grads_copied = all(g.place.grads.issued >= 1 and g.place.grads.copied == g.place.grads.issued
                           and g.place.grads.staging is None for g in groups)
        opt.step()
        opt.zero_grad()
        masters = [torch.empty(n) for n in engine.shard_sizes]
        engine.copy_masters_to(masters)
        records.append({
            "loss": loss.item(),
            # Copies in the whole iteration: the first gather's whole shard, then each bucket the
            # step wrote, during backward (a committed speculation) or in step().
            "copies": [g.place.uploads - b for g, b in zip(groups, before)],
            "committed": engine.commits - commits,
            "buckets": [sum(b.shard == g.place.index for b in engine.buckets) for g in groups],
            "distinct": all(g.place.sent.untyped_storage().data_ptr() != g.shard.untyped_storage().data_ptr()
                            for g in groups),
            "equal": all(torch.equal(g.place.sent, g.shard) for g in groups),
            "masters": all(torch.equal(g.shard, masters[g.place.index].to(g.shard.dtype)) for g in groups),
            "sent": all(g.place.gather_source(g.shard, g.gather_dtype, False, False) is g.place.sent for g in groups),
            "grads_copied": grads_copied,
        })
    return records


@pytest.mark.timeout(900)
def test_the_gathered_shard_is_a_copy_refreshed_bucket_by_bucket(launches: dict) -> None:
    """The parameters are views of a host shard; what the all-gather sends is a separate
    (device) buffer, copied whole once and then bucket by bucket as each step (taken during
    backward and committed from the second, in `step()` for the first) writes them; it equals the host shard and the masters in the
    state file after every step, and the gradients came back through offload="cpu"'s
    download path."""
    for rank, records in enumerate(outcome.result() for outcome in launches[2]["device-copy"]):
        assert len(records) == STEPS
        for step, record in enumerate(records):
            assert torch.isfinite(torch.tensor(record["loss"])), (rank, step)
            assert record["distinct"] and record["equal"] and record["masters"] and record["sent"], (rank, step)
            assert record["grads_copied"], (rank, step)
            assert record["copies"] == [n + (step == 0) for n in record["buckets"]], (rank, step, record)
            # The optimizer links to the model at its first step: that step is taken in step().
            assert record["committed"] == (0 if step == 0 else len(record["buckets"])), (rank, step, record)
        assert max(records[0]["buckets"]) > 1, records[0]["buckets"]


def _wrap(rank: int, world: int, kwargs: dict) -> str:
    from torch import nn

    from overlap import ShardedModule

    ShardedModule(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), **kwargs)
    return "built"


REFUSED = [
    ({"offload": "disk"}, "needs mixed_precision=MixedPrecision(param_dtype=torch.bfloat16"),
    ({"offload": "disk", "mixed_precision": BF16, "compression": "int8"}, "compression='int8' is not supported"),
    ({"offload": "disk", "mixed_precision": BF16, "compression": "int8-int4"}, "compression='int8-int4' is not"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("index,expected", [(i, expected) for i, (_, expected) in enumerate(REFUSED)])
def test_combinations_that_cannot_work_are_refused_on_every_rank(index: int, expected: str, launches: dict) -> None:
    for outcome in launches[2][f"refused-{index}"]:
        message = outcome.error()
        assert expected in message, message


def _other_optimizer(rank: int, world: int) -> str:
    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    batch = token_batches(SMALL_GPT.vocab_size, 12, steps=1)()[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _lm_loss(model, batch).backward()
    opt.step()
    try:
        _lm_loss(model, batch)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(900)
def test_another_optimizer_is_an_error_naming_overlap_adamw(launches: dict) -> None:
    for message in (outcome.result() for outcome in launches[2]["other-optimizer"]):
        assert "changed in place by something other than overlap.optim.AdamW" in message, message


def _full_load(rank: int, world: int) -> tuple[bool, float, float]:
    """Full tensors loaded into a disk-offloaded model (another model's values): whether its
    full state then equals them, and both models' next loss."""
    from overlap import ShardedModule

    torch.manual_seed(0)
    source = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    torch.manual_seed(1)
    target = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    values = source.full_state_dict()
    target.load_full_state_dict(values)
    loaded = target.full_state_dict()
    same = values.keys() == loaded.keys() and all(torch.equal(values[k], loaded[k]) for k in values)
    batch = token_batches(SMALL_GPT.vocab_size, 12, steps=1)()[0]
    with torch.no_grad():
        return same, float(_lm_loss(source, batch)), float(_lm_loss(target, batch))


@pytest.mark.timeout(900)
def test_loading_full_tensors_writes_the_masters_and_the_copies_gathers_send(launches: dict) -> None:
    for same, source_loss, target_loss in (outcome.result() for outcome in launches[1]["full-load"]):
        assert same
        assert math.isfinite(source_loss) and source_loss == target_loss


@pytest.mark.timeout(500)
def test_a_killed_disk_offloaded_run_resumes_from_its_checkpoint(tmp_path) -> None:
    check_killed_run_resumes(tmp_path, "disk", "overlap_adamw_dim_groups")


def _one_step(config: GPTConfig, rank: int, world: int):
    """A disk-offloaded GPT and its optimizer after one training step."""
    from overlap import ShardedModule
    from parity import _optimizer, _slice

    torch.manual_seed(0)
    model = ShardedModule(GPT(config), offload="disk", mixed_precision=BF16)
    optimizer = _optimizer("overlap_adamw_dim_groups", model)
    batch = token_batches(config.vocab_size, 12, steps=1)()[0]
    model(*_slice(batch, rank, world)).backward()
    optimizer.step()
    return model, optimizer


def _save_at(rank: int, world: int, path: str) -> dict:
    from overlap import checkpoint

    model, optimizer = _one_step(SMALL_GPT, rank, world)
    checkpoint.save(path, model, optimizer)
    return {"state": model.full_state_dict(), "moments": _full_moments(model, optimizer)}


def _load_at(rank: int, world: int, path: str) -> dict:
    from overlap import ShardedModule, checkpoint
    from parity import _optimizer

    torch.manual_seed(1)
    model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    optimizer = _optimizer("overlap_adamw_dim_groups", model)
    checkpoint.load(path, model, optimizer)
    return {"state": model.full_state_dict(), "moments": _full_moments(model, optimizer)}


def _full_moments(model, optimizer) -> dict:
    """Each parameter's exp_avg in full (all-gathered rows), by name."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        local = optimizer.state[p]["exp_avg"].reshape(-1) if p in optimizer.state else torch.zeros(0)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local.clone())
        out[name] = torch.cat(parts)
    return out


@pytest.mark.timeout(900)
def test_checkpoint_from_disk_state_reshards_on_load(launches: dict) -> None:
    """Saved at 2 ranks, loaded at 3 and at 1: the same fp32 masters and moments."""
    saved = launches[2]["save"][0].result()
    for world in (3, 1):
        loaded = launches[world]["load"][0].result()
        for key, value in saved["state"].items():
            assert value.dtype == torch.float32 or not value.is_floating_point(), key
            assert torch.equal(loaded["state"][key], value), (world, key)
        for name, value in saved["moments"].items():
            assert torch.count_nonzero(value) > 0 and torch.equal(loaded["moments"][name], value), (world, name)


def _meta_and_eager(rank: int, world: int) -> dict:
    from overlap import ShardedModule

    torch.manual_seed(0)
    eager = ShardedModule(GPT(SMALL_GPT), mixed_precision=BF16).full_state_dict()
    torch.manual_seed(0)
    with torch.device("meta"):
        inner = GPT(SMALL_GPT)
    model = ShardedModule(inner, offload="disk", mixed_precision=BF16)
    return {"eager": eager, "meta": model.full_state_dict(), "losses": _two_steps(model, rank, world)}


def _two_steps(model, rank: int, world: int) -> list[float]:
    from parity import _optimizer, _slice

    optimizer = _optimizer("overlap_adamw_dim_groups", model)
    losses = []
    for batch in token_batches(SMALL_GPT.vocab_size, 12, steps=2)():
        loss = model(*_slice(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.timeout(900)
def test_a_meta_device_model_is_materialised_into_the_state_file(launches: dict) -> None:
    """Built on the meta device, each part is written into the state file as it is made: the
    fp32 masters equal an eager build's, and it trains."""
    for result in (outcome.result() for outcome in launches[2]["meta"]):
        assert result["eager"].keys() == result["meta"].keys()
        for key, value in result["eager"].items():
            assert torch.equal(result["meta"][key], value), key
        assert all(torch.isfinite(torch.tensor(result["losses"]))) and result["losses"][0] != result["losses"][1]


# Wider than SMALL_GPT, so that this rank's moments (8 bytes per element of its shard) stand
# well above what a save or load holds for one stored item at a time (one parameter's chunk).
# The peak does not grow with depth: at n_layer=12 (3x the moments) a load at 1 rank peaked
# at the same 0.6 MB as here.
WIDE_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=128)


def _peak_allocated(events) -> int:
    """The most bytes the CPU allocator held at once above where profiling began, from the
    profiler's events in time order: each op's own net allocation, and the frees (and
    allocations) made outside any op. Memory maps of the state file are not allocations."""
    held = peak = 0
    for event in sorted(events, key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def _save_wide(rank: int, world: int, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from overlap import checkpoint

    model, optimizer = _one_step(WIDE_GPT, rank, world)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        checkpoint.save(path, model, optimizer)
    steps = {name: float(optimizer.state[p]["step"]) for name, p in model.named_parameters()}
    return {"state": model.full_state_dict(), "moments": _full_moments(model, optimizer), "steps": steps,
            **_allocation_figures(model, _peak_allocated(prof.events()))}


def _allocation_figures(model, peak: int) -> dict:
    """The peak next to what holding this rank's moments would take and to the bound."""
    from overlap.optim.paged import paged_of

    return {"peak": peak, "moments_bytes": 8 * sum(p.numel() for p in model.parameters() if paged_of(p) is not None),
            "largest_param_bytes": 4 * max(p.numel() for p in GPT(WIDE_GPT).parameters())}


def _check_peak(figures: dict, what: str) -> None:
    bound = 4 * figures["largest_param_bytes"]
    assert bound < figures["moments_bytes"] / 2, "the model is too narrow for the check to mean anything"
    assert 0 < figures["peak"] < bound, (what, figures)


def _load_wide_tracked(rank: int, world: int, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from overlap import ShardedModule, checkpoint
    from overlap.optim.paged import paged_of
    from overlap.runtime.disk_tier import master_part
    from parity import _optimizer

    torch.manual_seed(1)
    model = ShardedModule(GPT(WIDE_GPT), offload="disk", mixed_precision=BF16)
    optimizer = _optimizer("overlap_adamw_dim_groups", model)
    params = dict(model.named_parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        checkpoint.load(path, model, optimizer)
    with torch.no_grad():
        resident_equal = all(paged_of(p) is not None and torch.equal(p, master_part(p).to(p.dtype))
                             for p in params.values())
    return {**_allocation_figures(model, _peak_allocated(prof.events())), "resident_equal": resident_equal,
            "state": model.full_state_dict(), "moments": _full_moments(model, optimizer),
            "steps": {name: float(optimizer.state[p]["step"]) for name, p in params.items()},
            "moment_dtypes": {str(optimizer.state[p][k].dtype) for p in params.values()
                              for k in ("exp_avg", "exp_avg_sq")}}


@pytest.mark.timeout(900)
def test_checkpoints_stream_the_moments_through_the_state_file(launches: dict) -> None:
    """Saved at 2 ranks, loaded at 3 and at 1, each under the profiler: the CPU allocator
    never holds more than 4 parameters' worth of fp32 at once, below half this rank's
    moments. (Before they streamed, a load held all moments plus a 16-bit cast of them,
    3.3 MB against a 1 MB bound at 3 ranks, and a save copied every map of the file, 4.9 MB
    at 2.) What was loaded is what was saved: fp32 masters and moments, step counts, and
    16-bit shards equal to the masters rounded."""
    saved_per_rank = [outcome.result() for outcome in launches[2]["save-wide"]]
    for rank, figures in enumerate(saved_per_rank):
        _check_peak(figures, f"save, rank {rank}")
    saved = saved_per_rank[0]
    for world in (3, 1):
        for rank, loaded in enumerate(outcome.result() for outcome in launches[world]["load-wide"]):
            _check_peak(loaded, f"load at {world} ranks, rank {rank}")
            assert loaded["resident_equal"], (world, rank)
            assert loaded["moment_dtypes"] == {"torch.float32"}, (world, rank)
            assert loaded["steps"] == saved["steps"] and set(saved["steps"].values()) == {1.0}, (world, rank)
            for key, value in saved["state"].items():
                assert torch.equal(loaded["state"][key], value), (world, key)
            for name, value in saved["moments"].items():
                assert torch.count_nonzero(value) > 0 and torch.equal(loaded["moments"][name], value), (world, name)


def _async_save_streamed(rank: int, world: int, path: str) -> dict:
    """A step, an asynchronous save whose writer starts a second late, two more steps while it
    writes (the first writes the spare slots; the second would write the slots the save
    reads, and waits for it), then a load of the checkpoint: what was staged, and the state
    at the save, after the steps and as loaded."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    from overlap import ShardedModule, checkpoint
    from overlap.checkpoint import staging
    from overlap.optim.adamw import paged_moments
    from overlap.optim.paged import paged_of
    from parity import _optimizer

    staged: list[tuple[dict, dict, frozenset]] = []
    stage, write = staging.stage_items, FileSystemWriter.write_data

    def recorded(state_dict, streamed=frozenset()):
        out = stage(state_dict, streamed)
        staged.append((state_dict, out, streamed))
        return out

    def late(self, plan, planner):
        time.sleep(1.0)
        return write(self, plan, planner)

    staging.stage_items, FileSystemWriter.write_data = recorded, late
    try:
        torch.manual_seed(0)
        model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
        optimizer = _optimizer("overlap_adamw_dim_groups", model)
        paged = {name: p for name, p in model.named_parameters() if paged_of(p) is not None}

        def state() -> dict:
            moments = {f"{name}.{key}": value.clone() for name, p in paged.items()
                       for key, value in paged_moments(p).items()}
            return {**model.full_state_dict(), **moments}

        batches = token_batches(SMALL_GPT.vocab_size, 12, steps=3)()
        losses = []

        def step(batch) -> None:
            loss = _lm_loss(model, (batch[0][rank::world], batch[1][rank::world]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))

        step(batches[0])
        at_save = state()
        pending = checkpoint.async_save(path, model, optimizer)
        for batch in batches[1:]:
            step(batch)
        pending.wait()
        after = state()
        checkpoint.load(path, model, optimizer)
        loaded = state()
    finally:
        staging.stage_items, FileSystemWriter.write_data = stage, write
    (items, out, streamed), = staged
    return {"streamed": sorted(streamed), "paged": sorted(paged), "kept": sorted(k for k in streamed if out[k] is items[k]),
            "copied": sorted(k for k in items if k not in streamed and isinstance(items[k], torch.Tensor)
                             and out[k] is items[k]),
            "at_save": at_save, "after": after, "loaded": loaded, "losses": losses}


@pytest.mark.timeout(900)
def test_async_save_streams_the_disk_state_and_keeps_the_state_of_its_step(launches: dict) -> None:
    """The masters and moments of an asynchronous save are written from the state file (not
    staged), and the steps taken while it writes do not reach the checkpoint."""
    for result in (outcome.result() for outcome in launches[2]["async-save"]):
        paged = result["paged"]
        assert paged and result["streamed"] == sorted(
            [f"model.{name}" for name in paged]
            + [f"optimizer.state.{name}.{m}" for name in paged for m in ("exp_avg", "exp_avg_sq")])
        assert result["kept"] == result["streamed"] and not result["copied"]
        assert all(torch.isfinite(torch.tensor(loss)) for loss in result["losses"])
        at_save, after, loaded = result["at_save"], result["after"], result["loaded"]
        assert any(not torch.equal(after[key], value) for key, value in at_save.items())
        for key, value in at_save.items():
            assert torch.equal(loaded[key], value), key


def _optimizer_before_wrapping(rank: int, world: int) -> dict:
    """overlap.optim.AdamW built on the module before the wrap (a DDP script's order) and after
    it: losses, final masters and the steps taken during backward that were committed."""
    from overlap import ShardedModule
    from overlap.optim import AdamW
    from overlap.optim.paged import paged_of

    out = {}
    for order in ("after", "before"):
        torch.manual_seed(0)
        inner = GPT(SMALL_GPT)
        optimizer = AdamW(inner.parameters(), lr=1e-2) if order == "before" else None
        model = ShardedModule(inner, offload="disk", mixed_precision=BF16)
        optimizer = optimizer or AdamW(model.parameters(), lr=1e-2)
        engine = next(paged_of(p) for p in model.parameters() if paged_of(p) is not None).engine
        losses = []
        for batch in token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS)():
            loss = _lm_loss(model, (batch[0][rank::world], batch[1][rank::world]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        out[order] = {"losses": losses, "state": model.full_state_dict(), "commits": engine.commits,
                      "recomputes": engine.recomputes}
    return out


@pytest.mark.timeout(900)
def test_an_optimizer_built_before_wrapping_steps_during_backward_too(launches: dict) -> None:
    for result in (outcome.result() for outcome in launches[1]["optimizer-before"]):
        before, after = result["before"], result["after"]
        assert before["losses"] == after["losses"] and all(torch.isfinite(torch.tensor(before["losses"])))
        for key, value in after["state"].items():
            assert torch.equal(before["state"][key], value), key
        assert before["commits"] == after["commits"] > 0 and before["recomputes"] == 0


def _failed_load_then_good(rank: int, world: int, good: str, bad: str) -> dict:
    """A checkpoint, a damaged copy of it, a step on; then the damaged load fails partway
    (the items before the damage may already be in the state file), and the step and the
    save after it are refused; loading the good checkpoint makes the state whole again, and
    the step from it has the loss it had the first time."""
    import shutil

    from overlap import ShardedModule, checkpoint
    from overlap.checkpoint import CorruptCheckpoint
    from parity import _optimizer, _slice

    def step(batch) -> float:
        loss = model(*_slice(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16)
    optimizer = _optimizer("overlap_adamw_dim_groups", model)
    batches = token_batches(SMALL_GPT.vocab_size, 12, steps=3)()
    step(batches[0])
    checkpoint.save(good, model, optimizer)
    saved = {"state": model.full_state_dict(), "moments": _full_moments(model, optimizer)}
    shutil.copytree(good, bad)
    file = os.path.join(bad, max((n for n in os.listdir(bad) if n.endswith(".distcp")),
                                 key=lambda n: os.path.getsize(os.path.join(bad, n))))
    with open(file, "r+b") as f:                  # damage the last quarter: earlier items load first
        f.seek(os.path.getsize(file) * 3 // 4)
        tail = f.read()
        f.seek(os.path.getsize(file) * 3 // 4)
        f.write(bytes(b ^ 0xFF for b in tail))
    out: dict = {"first_loss": step(batches[1])}
    try:
        checkpoint.load(bad, model, optimizer)
    except CorruptCheckpoint:
        out["corrupt"] = True
    loss = model(*_slice(batches[2], rank, world))
    loss.backward()
    for what, call in (("step", optimizer.step), ("save", lambda: checkpoint.save(bad + "-again", model, optimizer))):
        try:
            call()
        except RuntimeError as e:
            out[what] = str(e)
    optimizer.zero_grad()
    checkpoint.load(good, model, optimizer)
    out["equal"] = all(torch.equal(v, saved["state"][k]) for k, v in model.full_state_dict().items()) and all(
        torch.equal(v, saved["moments"][k]) for k, v in _full_moments(model, optimizer).items())
    out["loss"] = step(batches[1])
    return out


@pytest.mark.timeout(900)
def test_a_load_that_fails_midway_leaves_the_state_refused_until_a_good_load(launches: dict) -> None:
    for result in (outcome.result() for outcome in launches[1]["failed-load"]):
        assert result.get("corrupt"), result
        for what in ("step", "save"):
            assert "inconsistent since a failed step or load (loading checkpoint" in result.get(what, ""), (what, result)
        assert result["equal"] and torch.isfinite(torch.tensor(result["loss"])), result
        assert result["loss"] == result["first_loss"], result


def _round_trip(rank: int, world: int, path: str, sharding: str) -> dict:
    """Save after a step, go on one step; a fresh model loads the checkpoint and takes the
    same step: the same masters, moments and loss."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    from overlap import ShardedModule, checkpoint
    from parity import _optimizer, _slice

    batches = token_batches(SMALL_GPT.vocab_size, 12, steps=2)()
    runs = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = ShardedModule(GPT(SMALL_GPT), offload="disk", mixed_precision=BF16, sharding=sharding)
        optimizer = _optimizer("overlap_adamw_dim_groups", model)
        if seed == 0:
            model(*_slice(batches[0], rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
            checkpoint.save(path, model, optimizer)
        else:
            checkpoint.load(path, model, optimizer)
        state = {"state": model.full_state_dict(), "moments": _full_moments(model, optimizer)}
        loss = model(*_slice(batches[1], rank, world))
        loss.backward()
        optimizer.step()
        runs[seed] = {**state, "loss": float(loss), "after": model.full_state_dict()}
    return runs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sharding", ["hybrid", "hpz"])
def test_checkpoint_round_trips_with_hybrid_and_hpz_sharding(sharding: str, launches: dict) -> None:
    for runs in (outcome.result() for outcome in launches[2][f"round-trip-{sharding}"]):
        saved, loaded = runs[0], runs[1]
        assert torch.isfinite(torch.tensor(saved["loss"])) and loaded["loss"] == saved["loss"], (saved["loss"],
                                                                                               loaded["loss"])
        assert all(torch.count_nonzero(value) > 0 for value in saved["moments"].values()), sharding
        for part in ("state", "moments", "after"):
            for key, value in saved[part].items():
                assert torch.equal(loaded[part][key], value), (sharding, part, key)


# ---- steps taken during backward (overlap.optim.speculation) ----------------------------------------

# Each phase, and what it does to each paged group's step taken ahead: (commits, recomputes,
# restores, steps from the buckets read ahead: [Note: choosing between them] in overlap.optim.paged).
PHASES = [
    ("plain", (1, 0, 0, 0)),               # the first step speculates
    ("clip-loose", (1, 0, 0, 0)),          # torch's clip multiplies by exactly 1: kept
    ("clip-tight", (0, 1, 0, 0)),          # the clip binds: recomputed, and the next step reads ahead
    ("scaled", (0, 0, 0, 1)),              # the user scales the gradients after backward
    ("lr-after-backward", (0, 0, 0, 1)),   # the learning rate changed between backward and step
    ("no_sync", (0, 0, 0, 1)),             # a no_sync micro-batch reduces nothing; unchanged: speculates again
    ("accumulate", (0, 0, 1, 0)),          # two reducing micro-batches: the second forward restores
    ("accumulate", (0, 0, 0, 0)),          # ... and the next step does not speculate
    ("plain", (0, 0, 0, 0)),               # nor the one after a step that followed two backwards
    ("plain", (1, 0, 0, 0)),
    ("skipped", (0, 0, 1, 0)),             # backward, zero_grad, backward, step
    ("plain", (0, 0, 0, 0)),
    ("forward-between", (0, 0, 1, 0)),     # a forward after backward, then the step
    ("plain", (1, 0, 0, 0)),
    ("no-grads", (0, 0, 1, 0)),            # backward, zero_grad, step: the step steps nothing
    ("plain", (0, 0, 0, 0)),               # (counts two reductions since the last step that stepped)
    ("plain", (0, 0, 0, 0)),
    ("plain", (1, 0, 0, 0)),
]


def _speculation_phases(rank: int, world: int, wrap: dict, local_world_size: int | None) -> dict:
    """PHASES with offload="none" and with "disk" (LambdaLR decays the learning rate after
    every step): losses, clip norms, the final fp32 masters and, on disk, the engine's counts
    after each phase."""
    from overlap import ShardedModule
    from overlap.optim.paged import paged_of
    from parity import _optimizer, _slice

    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    batches = token_batches(SMALL_GPT.vocab_size, 12, steps=2 * len(PHASES))()
    out = {}
    for offload in ("none", "disk"):
        torch.manual_seed(0)
        model = ShardedModule(GPT(SMALL_GPT), offload=offload, mixed_precision=BF16, **wrap)
        optimizer = _optimizer("overlap_adamw_dim_groups", model)
        model.optimizer_link.link(optimizer)            # before the first step: it speculates too
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        engine = paged_of(next(model.parameters())).engine if offload == "disk" else None
        losses, counts = [], []

        def backward(batch, no_sync: bool = False) -> None:
            with model.no_sync() if no_sync else contextlib.nullcontext():
                loss = model(*_slice(batch, rank, world))
                loss.backward()
            losses.append(float(loss.detach()))

        for index, (phase, _) in enumerate(PHASES):
            first, second = batches[2 * index], batches[2 * index + 1]
            backward(first, no_sync=phase == "no_sync")
            if phase in ("no_sync", "accumulate"):
                backward(second)
            elif phase == "clip-loose":
                losses.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e4)))
            elif phase == "clip-tight":
                losses.append(float(model.clip_grad_norm_(1e-4)))
            elif phase == "scaled":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            elif phase == "lr-after-backward":
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
            elif phase == "skipped":
                optimizer.zero_grad()
                backward(second)
            elif phase == "forward-between":
                with torch.no_grad():
                    losses.append(float(model(*_slice(second, rank, world))))
            elif phase == "no-grads":
                optimizer.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if engine is not None:
                counts.append((engine.commits, engine.recomputes, engine.restores, engine.read_aheads))
        out[offload] = {"losses": losses, "state": model.full_state_dict(), "counts": counts,
                        "groups": sum(g.place.offloaded for unit in model.scheduler.all_units for g in unit.groups)}
    return out


SPECULATION_CASES = {"plain": {}, "hybrid": {"sharding": "hybrid"}, "hpz": {"sharding": "hpz"}}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SPECULATION_CASES))
def test_steps_taken_during_backward_train_as_without_offload(name: str, launches: dict) -> None:
    """The speculative steps are committed where nothing changed after backward, recomputed
    or restored where something did, and training matches offload="none" bit for bit."""
    for rank, result in enumerate(outcome.result() for outcome in launches[2][f"speculation-{name}"]):
        ref, got = result["none"], result["disk"]
        assert got["losses"] == ref["losses"], (rank, got["losses"], ref["losses"])
        for key, value in ref["state"].items():
            assert torch.equal(got["state"][key], value), (rank, key)
        groups, before = got["groups"], (0, 0, 0, 0)
        assert groups >= 2
        for (phase, expected), after in zip(PHASES, got["counts"]):
            delta = tuple(a - b for a, b in zip(after, before))
            assert delta == tuple(groups * e for e in expected), (name, rank, phase, delta, expected)
            before = after


# ---- the launches ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, CaseLaunch]:
    """One launch per world size, each running its cases in turn (tests/distributed.py's
    [Note: many cases on one launch]); the loads at 1 and 3 ranks after the saves at 2. The
    ranks' state files and the checkpoints go to one directory of the module's."""
    directory = str(tmp_path_factory.mktemp("offload_disk"))

    def path(name: str) -> str:
        return os.path.join(directory, name)

    def trained(world: int) -> dict:
        return {f"train-{name}": RankCase(_both, (wrap, micro_batches, clip, local_world_size))
                for name, case_world, wrap, micro_batches, clip, local_world_size in CASES if case_world == world}

    def loads() -> dict:
        return {"load": RankCase(_load_at, (path("ckpt"),)), "load-wide": RankCase(_load_wide_tracked, (path("wide"),))}

    env = {"OVERLAP_OFFLOAD_DIR": directory}
    saves = CaseLaunch({
        **trained(2),
        "device-copy": RankCase(_device_copy),
        **{f"refused-{i}": RankCase(_wrap, (kwargs,)) for i, (kwargs, _) in enumerate(REFUSED)},
        "other-optimizer": RankCase(_other_optimizer),
        "save": RankCase(_save_at, (path("ckpt"),)),
        "meta": RankCase(_meta_and_eager),
        "save-wide": RankCase(_save_wide, (path("wide"),)),
        "async-save": RankCase(_async_save_streamed, (path("async"),)),
        **{f"round-trip-{sharding}": RankCase(_round_trip, (path(f"round-trip-{sharding}"), sharding))
           for sharding in ("hybrid", "hpz")},
        **{f"speculation-{name}": RankCase(_speculation_phases, (wrap, 1 if wrap else None))
           for name, wrap in SPECULATION_CASES.items()},
    }, world_size=2, env=env, timeout=800)
    return {
        2: saves,
        1: CaseLaunch({**trained(1), **loads(), "full-load": RankCase(_full_load),
                       "failed-load": RankCase(_failed_load_then_good, (path("good"), path("bad"))),
                       "optimizer-before": RankCase(_optimizer_before_wrapping)},
                      world_size=1, env=env, timeout=800, after=[saves]),
        3: CaseLaunch({**trained(3), **loads()}, world_size=3, env=env, timeout=800, after=[saves]),
    }
