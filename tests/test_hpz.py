"""hpZ (primary shards over every rank, a node-local copy for backward's gathers) on one host
whose 4 ranks are told they form 2 nodes of 2 (LOCAL_WORLD_SIZE=2): training equals one
process on the same global batches, with compression too, and backward gathers from the node
copies."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from distributed import CaseLaunch, RankCase
from parity import train
from parity_cases import CASES
from test_compression import LOSS_RTOL, UPDATE_RTOL

HPZ_CASES = ["features_bucketed", "gpt_adamw_groups", "gpt_no_sync"]


def _train_hpz(rank: int, world: int, names: list[str]) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    results = {}
    for name in names:
        case = dataclasses.replace(CASES[name], wrap={**CASES[name].wrap, "sharding": "hpz"})
        results[name] = train(case, rank, world, sharded=True)
    return results


@pytest.mark.timeout(600)
def test_hpz_trains_like_one_process() -> None:
    got = LAUNCHES[4]["train"][0].result()
    for name in HPZ_CASES:
        case, ref = CASES[name], train(CASES[name])
        assert got[name]["sharding"] == "hpZ: full sharding over 4 ranks, backward gathers over 2 ranks per node"
        tol = {"rtol": case.rtol, "atol": case.atol}
        torch.testing.assert_close(torch.tensor(got[name]["losses"]), torch.tensor(ref["losses"]), **tol)
        for key, expected in ref["state"].items():
            torch.testing.assert_close(got[name]["state"][key], expected, **tol, msg=lambda m: f"{name} {key}: {m}")


# SGD with no_sync micro-batches. Measured at 4 ranks against one process: losses within
# 0.06%, updates within 12% (int8) and 12.4% (int8-int4), against tests/test_compression.py's
# SGD bound of 20%.
COMPRESSED_CASE = "gpt_no_sync"
COMPRESSION_MODES = ("int8", "int8-int4")


def _train_hpz_compressed(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    case = CASES[COMPRESSED_CASE]
    return {mode: train(dataclasses.replace(case, wrap={"sharding": "hpz", "compression": mode}), rank, world,
                        sharded=True)
            for mode in COMPRESSION_MODES}


@pytest.mark.timeout(600)
def test_hpz_with_compression_trains_like_one_process() -> None:
    """The node copy is taken from the dequantised gathered weights: training stays as close
    to one process as compressed training does (tests/test_compression.py's bounds)."""
    got = LAUNCHES[4]["compressed"][0].result()
    ref = train(CASES[COMPRESSED_CASE])
    torch.manual_seed(0)
    initial = {k: v.detach().clone() for k, v in CASES[COMPRESSED_CASE].build().state_dict().items()}
    moved = [k for k in ref["state"] if not torch.equal(ref["state"][k], initial[k])]
    delta_ref = torch.cat([(ref["state"][k] - initial[k]).flatten().float() for k in moved])
    for mode in COMPRESSION_MODES:
        losses, ref_losses = got[mode]["losses"], torch.tensor(ref["losses"])
        assert all(math.isfinite(loss) for loss in losses), (mode, losses)
        assert ((torch.tensor(losses) - ref_losses).abs() / ref_losses.abs()).max() <= LOSS_RTOL[mode], mode
        delta = torch.cat([(got[mode]["state"][k] - initial[k]).flatten().float() for k in moved])
        assert (delta - delta_ref).norm() / delta_ref.norm() <= UPDATE_RTOL[mode], mode


def _gathers_per_step(rank: int, world: int) -> list[list[tuple[str, int]]]:
    """(unit, ranks gathering) for every all-gather of two training steps."""
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.models import GPT
    from parity_cases import SMALL_GPT

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.manual_seed(0)
    model = ShardedModule(GPT(SMALL_GPT), sharding="hpz", bucket_mb=0.01)
    collectives = model.collectives
    seen: list[tuple[str, int]] = []
    issue = collectives.all_gather

    def recording(out, shard, unit, group=None):
        seen.append((unit, dist.get_world_size(collectives.group if group is None else group)))
        return issue(out, shard, unit, group)

    collectives.all_gather = recording
    steps = []
    for _ in range(2):
        tokens = torch.randint(0, SMALL_GPT.vocab_size, (2, 12))
        model(tokens, tokens).backward()
        steps.append(list(seen))
        seen.clear()
    return steps


@pytest.mark.timeout(600)
def test_backward_gathers_from_the_node_copy() -> None:
    for steps in (outcome.result() for outcome in LAUNCHES[4]["gathers"]):
        for gathers in steps:
            by_unit: dict[str, list[int]] = {}
            for unit, ranks in gathers:
                by_unit.setdefault(unit, []).append(ranks)
            # Each unit is gathered once over all 4 ranks (forward); any second gather is
            # backward's, inside the node (2 ranks), from the copy forward kept.
            assert all(ranks[0] == 4 and all(r == 2 for r in ranks[1:]) for ranks in by_unit.values()), by_unit
            assert sum(len(ranks) - 1 for ranks in by_unit.values()) >= 2, by_unit


def _hpz_with_a_mesh(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from overlap import ShardedModule

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ShardedModule(torch.nn.Linear(4, 4), mesh=mesh, sharding="hpz")


@pytest.mark.timeout(600)
def test_hpz_with_a_mesh_fails_on_every_rank() -> None:
    errors = [outcome.error() for outcome in LAUNCHES[4]["mesh"]]
    assert all("sharding='hpz'" in error and "pass no mesh" in error for error in errors)


def _hpz_on_uneven_nodes(rank: int, world: int) -> None:
    from overlap import ShardedModule

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ShardedModule(torch.nn.Linear(4, 4), sharding="hpz")


@pytest.mark.timeout(300)
def test_hpz_on_uneven_nodes_fails_on_every_rank() -> None:
    errors = [outcome.error() for outcome in LAUNCHES[3]["uneven"]]
    assert all("world size 3 is not a multiple of LOCAL_WORLD_SIZE 2" in e for e in errors)


def _collectives_while_grouping(rank: int, world: int) -> dict:
    """For hpZ and hybrid sharding: the groups (as global ranks) that each all-reduce made
    while the groups were built ran over, and the groups built."""
    import torch.distributed as dist

    from overlap.runtime.mesh import resolve_sharding

    seen: list[list[int]] = []
    all_reduce = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording
    result = {}
    try:
        for sharding in ("hpz", "hybrid"):
            seen.clear()
            groups = resolve_sharding(None, None, sharding, 2, "cpu")
            built = groups.node if sharding == "hpz" else groups.replicate
            result[sharding] = (list(seen), dist.get_process_group_ranks(built))
    finally:
        dist.all_reduce = all_reduce
    return result


# One launch per world size, its cases in turn (tests/distributed.py's [Note: many cases on one launch]).
LAUNCHES = {
    4: CaseLaunch({"train": RankCase(_train_hpz, (HPZ_CASES,)), "compressed": RankCase(_train_hpz_compressed),
                   "gathers": RankCase(_gathers_per_step), "mesh": RankCase(_hpz_with_a_mesh),
                   "grouping": RankCase(_collectives_while_grouping)}, world_size=4, timeout=540),
    3: CaseLaunch({"uneven": RankCase(_hpz_on_uneven_nodes)}, world_size=3, timeout=240),
}


@pytest.mark.timeout(600)
def test_groups_first_used_in_backward_communicate_at_construction() -> None:
    """hpZ's node group and hybrid's replicate group first communicate mid-backward, on
    autograd's thread; one collective at construction makes their communicators at start-up."""
    for rank, result in enumerate(outcome.result() for outcome in LAUNCHES[4]["grouping"]):
        seen, node = result["hpz"]
        assert node == [0, 1] if rank < 2 else [2, 3]
        assert seen == [node], (rank, seen)
        seen, replicas = result["hybrid"]
        assert replicas == [rank % 2, rank % 2 + 2]
        assert seen == [replicas], (rank, seen)
