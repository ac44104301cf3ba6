"""offload="cpu" trains exactly as offload="none": the same model, batches and optimizer run
both ways in one launch, at world sizes 1-3, with mixed precision, no_sync, clipping,
hybrid sharding, hpZ and compression; a run killed after a checkpoint taken with offloaded
state resumes to the uninterrupted run's losses.

On a machine without CUDA host and device are one memory, but the offloaded run still keeps
separate host shards and device buffers and copies between them (overlap.runtime.host_tier),
so every comparison here can fail: a copy missed or late leaves stale weights or gradients.
Both runs do the same arithmetic in the same order, so they are compared bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

from killed_resume import check_killed_run_resumes
from distributed import CaseLaunch, RankCase
from parity import Case, train, token_batches
from parity_cases import SMALL_GPT, _lm_loss

from overlap import MixedPrecision
from overlap.models import GPT

STEPS = 3
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _case(optimizer: str, wrap: dict, micro_batches: int = 1, clip: float | None = None) -> Case:
    # An evaluation forward (no_grad) after every step: a forward with no step before the next
    # one, which must send what the step left (the persistent bf16 copy is not refreshed twice).
    return Case("offload", lambda: GPT(SMALL_GPT), _lm_loss, token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS),
                optimizer=optimizer, wrap=wrap, micro_batches=micro_batches, clip=clip, eval_every_step=True)


def _both(rank: int, world: int, optimizer: str, wrap: dict, micro_batches: int, clip: float | None,
          local_world_size: int | None) -> dict:
    """The run without offload and with it, on this rank, plus what the offloaded model held."""
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    seen = {}

    def inspect(model) -> None:
        groups = [g for unit in model.scheduler.all_units for g in unit.groups]
        seen["offloaded"] = all(g.place.offloaded for g in groups)
        seen["resident"] = any(g.resident for g in groups)
        # The user's parameters and gradients are views of the host shards; nothing stays staged.
        seen["params_on_host"] = all(p.numel() == 0 or any(
            g.shard.data_ptr() <= p.data_ptr() < g.shard.data_ptr() + g.shard.nbytes for g in groups)
            for p in model.parameters())
        seen["staging_left"] = sum(g.place.staging is not None for g in groups)

    out = {"none": train(_case(optimizer, {**wrap, "offload": "none"}, micro_batches, clip), rank, world, sharded=True)}
    out["cpu"] = train(_case(optimizer, {**wrap, "offload": "cpu"}, micro_batches, clip), rank, world, sharded=True,
                       after=inspect)
    out["cpu"].update(seen)
    return out


CASES = [
    # (id, world, optimizer, wrap, micro-batches, clip, LOCAL_WORLD_SIZE)
    ("w1-sgd", 1, "sgd", {}, 1, None, None),
    ("w1-adamw-bf16", 1, "adamw", {"mixed_precision": BF16}, 1, None, None),
    ("w2-sgd", 2, "sgd", {}, 1, None, None),
    ("w2-adamw-groups", 2, "adamw_groups", {}, 1, None, None),
    ("w2-overlap-adamw", 2, "overlap_adamw", {}, 1, None, None),
    ("w2-overlap-adamw-bf16", 2, "overlap_adamw", {"mixed_precision": BF16}, 1, None, None),
    ("w2-bf16-no_sync-clip", 2, "sgd", {"mixed_precision": BF16}, 2, 0.05, None),
    ("w2-int8", 2, "sgd", {"compression": "int8"}, 1, None, None),
    ("w2-bf16-sgd-through-data", 2, "sgd_through_data", {"mixed_precision": BF16}, 1, None, None),
    ("w2-int8-int4-bf16", 2, "adamw", {"compression": "int8-int4", "mixed_precision": BF16}, 1, None, None),
    ("w2-hybrid", 2, "sgd", {"sharding": "hybrid"}, 1, None, 1),
    ("w2-hpz-bf16", 2, "sgd", {"sharding": "hpz", "mixed_precision": BF16}, 1, 0.05, 1),
    ("w3-sgd-no_sync", 3, "sgd", {}, 2, None, None),
    ("w3-adamw-clip", 3, "adamw", {}, 1, 0.05, None),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,world", [c[:2] for c in CASES], ids=[c[0] for c in CASES])
def test_offloaded_training_equals_training_on_the_device(name: str, world: int) -> None:
    per_rank = [outcome.result() for outcome in LAUNCHES[world][name]]
    for rank, result in enumerate(per_rank):
        ref, got = result["none"], result["cpu"]
        assert got["offloaded"] and not got["resident"] and got["params_on_host"], rank
        assert got["staging_left"] == 0, rank
        assert all(torch.isfinite(torch.tensor(got["losses"]))), got["losses"]
        assert got["losses"] == ref["losses"], (rank, got["losses"], ref["losses"])
        assert got["norms"] == ref["norms"], (rank, got["norms"], ref["norms"])
        assert got["eval_losses"] == ref["eval_losses"], (rank, got["eval_losses"], ref["eval_losses"])
        for key, value in ref["state"].items():
            assert torch.equal(got["state"][key], value), (rank, key)
    # The comparison can fail: training changed the loss.
    assert per_rank[0]["none"]["losses"][0] != per_rank[0]["none"]["losses"][-1]


@pytest.mark.timeout(500)
def test_a_killed_offloaded_run_resumes_from_its_checkpoint(tmp_path) -> None:
    check_killed_run_resumes(tmp_path, "cpu", "adamw")


def _load_after_forward(rank: int, world: int) -> tuple[float, float, float]:
    """A model that already gathered (its bf16 device copy made) loads another's full state
    dict: its next forward must compute with the loaded values."""
    from overlap import ShardedModule
    from parity import _slice

    batch = _slice(token_batches(SMALL_GPT.vocab_size, 12, steps=1)()[0], rank, world)
    torch.manual_seed(0)
    source = ShardedModule(GPT(SMALL_GPT), offload="cpu", mixed_precision=BF16)
    torch.manual_seed(1)
    target = ShardedModule(GPT(SMALL_GPT), offload="cpu", mixed_precision=BF16)
    with torch.no_grad():
        before = float(target(*batch))
        target.load_full_state_dict(source.full_state_dict())
        return before, float(source(*batch)), float(target(*batch))


@pytest.mark.timeout(900)
def test_a_state_dict_loaded_after_a_forward_is_what_the_next_forward_sends() -> None:
    for before, expected, got in (outcome.result() for outcome in LAUNCHES[2]["load-after-forward"]):
        assert before != expected and got == expected, (before, got, expected)


def _trained(world: int) -> dict[str, RankCase]:
    return {name: RankCase(_both, tuple(settings)) for name, case_world, *settings in CASES if case_world == world}


# One launch per world size, its cases in turn (tests/distributed.py's [Note: many cases on one launch]).
LAUNCHES = {
    1: CaseLaunch(_trained(1), world_size=1, timeout=800),
    2: CaseLaunch({**_trained(2), "load-after-forward": RankCase(_load_after_forward)}, world_size=2, timeout=800),
    3: CaseLaunch(_trained(3), world_size=3, timeout=800),
}
