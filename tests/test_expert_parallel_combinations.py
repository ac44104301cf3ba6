"""Expert parallelism with the runtime's other modes: host and disk offload, compiled units,
int8 on the wire, hybrid sharding, the planner's choice of sharding, and under `fully_shard`
torch's offload and precision policies and int8; hpZ refused on every rank. Each trains the GPT-MoE of
tests/test_expert_parallel.py at E = 2 against one process (DDP's semantics) on the same
global batches, or, where the mode changes the numbers on purpose (bf16, int8), against the
same mode without expert parallelism. Compiled units, int8, hybrid and the planner's sharding
run in the slow tier (`make test-all`), in launches of their own; hpZ's refusal there too, and
in the default tier through `overlap train` (tests/test_train_job.py)."""
from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

from distributed import CaseLaunch, RankCase
from test_expert_parallel import PER_RANK, _batches, _loss, _model, _optimizer, one_process

FP32_SGD = {"rtol": 1e-5, "atol": 1e-6}
FP32_ADAMW = {"rtol": 1e-4, "atol": 1e-5}     # as tests/test_expert_parallel.py: AdamW near zero gradients


def train(rank: int, world: int, expert_parallel: Optional[int], optimizer: str, options: dict[str, Any],
          bf16: bool = False, per_node: Optional[int] = None) -> dict:
    import torch.distributed as dist

    from overlap import MixedPrecision, ShardedModule
    from overlap.optim import AdamW

    if per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)       # this host's ranks as nodes of `per_node`
    model = _model("gpt_moe", None)
    if options.get("fully_shard"):
        model, opt = _fully_sharded(model, expert_parallel, optimizer, options, bf16)
    else:
        # The disk tier steps with overlap.optim.AdamW (torch's update, its own kernel).
        opt = AdamW(model.parameters(), lr=1e-2) if optimizer == "overlap-adamw" else \
            _optimizer(model.parameters(), optimizer)
        precision = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        model = ShardedModule(model, expert_parallel=expert_parallel, mixed_precision=precision, **options)
    losses = []
    for x, y in _batches(world):
        loss = _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK],
                     "gpt_moe")
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    state = _full_state(model) if options.get("fully_shard") else model.full_state_dict(rank0_only=True)
    return {"losses": losses, "state": state}


def _fully_sharded(model: torch.nn.Module, expert_parallel: Optional[int], optimizer: str, options: dict[str, Any],
                   bf16: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model under `fully_shard` (blocks, then the root), the mode given as FSDP2's
    policies and OverlapPolicy, and its optimizer over the DTensor parameters."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from overlap import OverlapPolicy, fully_shard

    policies: dict[str, Any] = {}
    if options.get("offload") == "cpu":
        policies["offload_policy"] = CPUOffloadPolicy()
    if bf16:
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **policies)
    fully_shard(model, **policies, overlap_policy=OverlapPolicy(expert_parallel=expert_parallel,
                                                               compression=options.get("compression")))
    return model, _optimizer(model.parameters(), optimizer)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def refused(rank: int, world: int, options: dict[str, Any], per_node: int) -> str:
    from overlap import ShardedModule

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        ShardedModule(_model("gpt_moe", None), expert_parallel=2, **options)
    except ValueError as exc:
        return str(exc)
    return "returned"


# name -> (world, expert parallel, optimizer, wrap options, bf16, ranks per node)
RUNS: dict[str, tuple[int, Optional[int], str, dict[str, Any], bool, Optional[int]]] = {
    "offload-cpu": (2, 2, "adamw", {"offload": "cpu"}, False, None),
    "bf16": (2, 2, "overlap-adamw", {}, True, None),
    "bf16-offload-disk": (2, 2, "overlap-adamw", {"offload": "disk"}, True, None),
    # Under fully_shard: torch's CPUOffloadPolicy and MixedPrecisionPolicy with OverlapPolicy's experts.
    "fully_shard-offload-cpu": (2, 2, "adamw", {"fully_shard": True, "offload": "cpu"}, False, None),
    "fully_shard-bf16-offload-cpu": (2, 2, "adamw", {"fully_shard": True, "offload": "cpu"}, True, None),
}
# The slow tier's (`make test-all`), launches of their own: compiled units and int8 at 2 ranks;
# hybrid sharding and the planner's choice (hpZ left out of its candidates) at 4 ranks as two
# nodes of two, with hpZ's refusal.
SLOW_RUNS: dict[str, tuple[int, Optional[int], str, dict[str, Any], bool, Optional[int]]] = {
    "compile": (2, 2, "sgd", {"compile": True}, False, None),
    "int8": (2, 2, "adamw", {"compression": "int8"}, False, None),
    "int8-no-ep": (2, None, "adamw", {"compression": "int8"}, False, None),
    "fully_shard-int8": (2, 2, "adamw", {"fully_shard": True, "compression": "int8"}, False, None),
    "hybrid": (4, 2, "sgd", {"sharding": "hybrid"}, False, 2),
    "auto": (4, 2, "sgd", {"sharding": "auto"}, False, 2),
}
# Compared with one process.
EXACT = {"offload-cpu": FP32_ADAMW, "fully_shard-offload-cpu": FP32_ADAMW}
SLOW_EXACT = {"compile": FP32_SGD, "hybrid": FP32_SGD, "auto": FP32_SGD}


@pytest.fixture(scope="module")
def launches() -> dict[int, CaseLaunch]:
    return {2: CaseLaunch({name: RankCase(train, run[1:]) for name, run in RUNS.items()}, world_size=2, timeout=300)}


@pytest.fixture(scope="module")
def slow_launches() -> dict[int, CaseLaunch]:
    out = {}
    for world in (2, 4):
        cases = {name: RankCase(train, run[1:]) for name, run in SLOW_RUNS.items() if run[0] == world}
        if world == 4:
            cases["hpz"] = RankCase(refused, ({"sharding": "hpz"}, 2))
        out[world] = CaseLaunch(cases, world_size=world, timeout=300)
    return out


def _results(launches: dict[int, CaseLaunch], name: str, runs: dict = RUNS) -> list[dict]:
    return [outcome.result() for outcome in launches[runs[name][0]][name]]


def _check_against_one_process(outcomes: list[dict], world: int, optimizer: str, tolerance: dict) -> None:
    reference = one_process(world, "gpt_moe", "normal", optimizer, 0.0, None)
    for result in outcomes:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=1e-6)
    for key, value in reference["state"].items():
        torch.testing.assert_close(outcomes[0]["state"][key], value, **tolerance, msg=lambda m: f"{key}: {m}")
    assert reference["losses"][0] != reference["losses"][-1]


def _max_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(state) == set(reference)
    return max(float((state[key].float() - value.float()).abs().max()) for key, value in reference.items())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", EXACT)
def test_trains_like_one_process(launches, name: str) -> None:
    world, _, optimizer, _, _, _ = RUNS[name]
    _check_against_one_process(_results(launches, name), world, optimizer, EXACT[name])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SLOW_EXACT)
def test_slow_tier_modes_train_like_one_process(slow_launches, name: str) -> None:
    world, _, optimizer, _, _, _ = SLOW_RUNS[name]
    _check_against_one_process(_results(slow_launches, name, SLOW_RUNS), world, optimizer, SLOW_EXACT[name])


@pytest.mark.timeout(600)
def test_disk_offload_equals_bf16_without_offload(launches) -> None:
    """The disk tier's step is the same update by the same optimizer: bitwise the same training."""
    disk, memory = _results(launches, "bf16-offload-disk")[0], _results(launches, "bf16")[0]
    assert disk["losses"] == memory["losses"] and all(torch.isfinite(torch.tensor(disk["losses"])))
    assert _max_difference(disk["state"], memory["state"]) == 0.0


@pytest.mark.timeout(600)
def test_bf16_under_fully_shard_stays_within_bf16s_own_error(launches) -> None:
    """bf16 compute with experts split under fully_shard against one process in fp32 (torch's
    AdamW): the losses within bf16's rounding, every parameter near."""
    reference = one_process(2, "gpt_moe", "normal", "adamw", 0.0, None)
    result = _results(launches, "fully_shard-bf16-offload-cpu")[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=2e-2)
    assert 0.0 < _max_difference(result["state"], reference["state"]) < 5e-2


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["int8", "fully_shard-int8"])
def test_int8_with_expert_parallel_stays_within_int8s_own_error(slow_launches, name: str) -> None:
    """int8 gathers move the numbers on purpose; with experts split they move them no more than
    without (each against one process in fp32), under ShardedModule and under fully_shard."""
    reference = one_process(2, "gpt_moe", "normal", "adamw", 0.0, None)
    with_ep, without = (_results(slow_launches, each, SLOW_RUNS)[0] for each in (name, "int8-no-ep"))
    error = _max_difference(with_ep["state"], reference["state"])
    assert 0.0 < error <= 2 * _max_difference(without["state"], reference["state"]), error
    torch.testing.assert_close(torch.tensor(with_ep["losses"]), torch.tensor(reference["losses"]),
                               rtol=0, atol=1e-2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hpz_is_refused_on_every_rank(slow_launches) -> None:
    for outcome in slow_launches[4]["hpz"]:
        message = outcome.result()
        assert "expert_parallel with sharding='hpz' is not supported" in message, message
