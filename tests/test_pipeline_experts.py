"""Expert parallelism inside pipeline stages: each stage's MoE blocks wrapped with
`ShardedModule(stage, mesh=mesh["dp"], expert_parallel=2)`, their experts split over the
stage's data-parallel ranks and their tokens sent by all-to-all while torch's schedules
interleave microbatches, against one process training every block on the global batch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase
from test_pipeline import _loss, train_microbatched

BLOCKS, STEPS, MICROBATCHES, PER_DP_RANK, SEQ, WIDTH = 4, 3, 2, 4, 4, 16
# A router bias that sends every token to experts 0 and 1 (the first expert-parallel rank's):
# the other rank of each pair receives no token, and experts 2 and 3 get no gradient.
SKEWED = (20.0, 10.0, -10.0, -10.0)


def _blocks(routing: str) -> list[nn.Module]:
    from overlap.models.moe import MoEBlock, MoEConfig

    torch.manual_seed(0)
    config = MoEConfig(vocab_size=8, block_size=SEQ, n_layer=BLOCKS, n_head=2, n_embd=WIDTH, n_expert=4, top_k=2,
                       expert_hidden=8)
    blocks = [MoEBlock(config) for _ in range(BLOCKS)]
    if routing == "skewed":
        for block in blocks:
            block.moe.router.register_forward_hook(lambda m, args, out: out + torch.tensor(SKEWED, dtype=out.dtype))
    return blocks


def _batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_DP_RANK * dp, SEQ, WIDTH, generator=gen),
             torch.randn(PER_DP_RANK * dp, SEQ, WIDTH, generator=gen)) for _ in range(STEPS)]


def _one_process(dp: int, routing: str) -> dict[str, torch.Tensor]:
    """AdamW on the mean of every data-parallel rank's microbatch losses."""
    model = nn.Sequential(*_blocks(routing))
    return train_microbatched(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _batches(dp),
                              PER_DP_RANK // MICROBATCHES)


def train_stages(rank: int, world: int, schedule: str, routing: str) -> dict[str, torch.Tensor]:
    """This rank's stages after STEPS steps at (pp 2, dp 2), experts split in pairs of the
    stage's ranks: the whole model's full values by key, and the all-to-alls each stage ran."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from overlap import ShardedModule

    pp, dp = 2, world // 2
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    multi = schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
    count = 2 * pp if multi else pp
    indices = [pp_rank, pp_rank + pp] if multi else [pp_rank]
    per_stage = BLOCKS // count
    blocks = _blocks(routing)
    stages, wrapped = [], {}
    for index in indices:
        layers = nn.Sequential(*blocks[index * per_stage:(index + 1) * per_stage])
        wrapped[index] = ShardedModule(layers, mesh=mesh["dp"], expert_parallel=2)
        stages.append(PipelineStage(wrapped[index], index, count, torch.device("cpu"), group=mesh["pp"].get_group()))
    runner = getattr(pipelining, f"Schedule{schedule}")(stages if multi else stages[0], n_microbatches=MICROBATCHES,
                                                        loss_fn=_loss)
    optimizer = torch.optim.AdamW([p for module in wrapped.values() for p in module.parameters()], lr=1e-2)
    rows = slice(dp_rank * PER_DP_RANK, (dp_rank + 1) * PER_DP_RANK)
    for x, y in _batches(dp):
        runner.step(*((x[rows],) if 0 in wrapped else ()), **({"target": y[rows]} if count - 1 in wrapped else {}))
        optimizer.step()
        optimizer.zero_grad()
    out: dict = {"all-to-all": [sum(step.all_to_alls for step in module.overlap_report().steps)
                                for module in wrapped.values()]}
    for index, module in wrapped.items():
        for key, value in module.full_state_dict().items():
            block, rest = key.split(".", 1)
            out[f"{index * per_stage + int(block)}.{rest}"] = value
    return out


def tensor_parallel_stage(rank: int, world: int) -> str:
    """A stage of a (pp 1, dp 2, tp 2) mesh whose attention output is split by torch's tensor
    parallelism, wrapped with expert parallelism: the error every rank raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from overlap import ShardedModule

    mesh = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("pp", "dp", "tp"))
    layers = nn.Sequential(*_blocks("normal")[:2])
    for block in layers:
        parallelize_module(block.attn, mesh["tp"], {"proj": RowwiseParallel()})
    with pytest.raises(ValueError) as refused:
        ShardedModule(layers, mesh=mesh["dp"], expert_parallel=2)
    return str(refused.value)


# Interleaved1F1B and InterleavedZeroBubble: two stages per rank (stages r and r + 2); the
# latter splits each backward into an input step and a weight step (a backward per group of
# parameters from where it joins the input's path: see [Note: routing that cannot hang]).
# AdamW against one process, as tests/test_expert_parallel.py compares it: a gradient near zero
# (a bias the other microbatch's rounding flips) moves its element by up to the learning rate.
ADAMW = {"rtol": 1e-4, "atol": 1e-5}
CASES = [(schedule, routing) for schedule in ("1F1B", "Interleaved1F1B") for routing in ("normal", "skewed")] + \
    [("InterleavedZeroBubble", "skewed")]


@pytest.fixture(scope="module")
def launch() -> CaseLaunch:
    cases = {f"{schedule}:{routing}": RankCase(train_stages, (schedule, routing)) for schedule, routing in CASES}
    return CaseLaunch({**cases, "tensor parallel": RankCase(tensor_parallel_stage)}, world_size=4, timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule,routing", CASES)
def test_expert_parallel_stages_train_like_one_process(launch, schedule: str, routing: str) -> None:
    reference, seen = _one_process(2, routing), set()
    for outcome in launch[f"{schedule}:{routing}"]:
        result = dict(outcome.result())
        assert all(calls > 0 for calls in result.pop("all-to-all")), "no all-to-all ran"
        for key, value in result.items():
            torch.testing.assert_close(value, reference[key], **ADAMW, msg=lambda m: f"{key}: {m}")
            seen.add(key)
    assert seen == set(reference)


@pytest.mark.timeout(600)
def test_expert_parallelism_with_tensor_parallel_stages_is_refused_on_every_rank(launch) -> None:
    for outcome in launch["tensor parallel"]:
        message = outcome.result()
        assert "expert_parallel=2 with tensor parallelism" in message, message
