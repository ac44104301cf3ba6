"""Three axes at once: pipeline stages (pp 2), each sharded by ZeRO-3 over dp 2 and split by
torch's tensor parallelism over tp 2, on a ('pp', 'dp', 'tp') mesh of 8 gloo ranks, against
one process training the whole model on the global batch. Both wraps of a stage: one
`ShardedModule(stage, mesh=mesh['dp'])` and FSDP2's pattern with `overlap.fully_shard`."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase

WIDTH, LAYERS, MICROBATCHES, STEPS, PER_DP_RANK = 8, 4, 2, 2, 4
PP, DP, TP = 2, 2, 2
# 1F1B, and a zero-bubble schedule (its weight step writes each weight's `.grad` itself).
SCHEDULES = ("1F1B", "ZBVZeroBubble")


class Block(nn.Module):
    """A residual MLP: `up` split by columns over tp, `down` by rows (Megatron's pair)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(LAYERS)])


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_DP_RANK * DP, WIDTH, generator=gen), torch.randn(PER_DP_RANK * DP, WIDTH, generator=gen))
            for _ in range(STEPS)]


def _one_process() -> dict[str, torch.Tensor]:
    """SGD on the mean of every microbatch loss of every dp rank."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    size = PER_DP_RANK // MICROBATCHES
    for x, y in _batches():
        losses = [_loss(model(x[i * size:(i + 1) * size]), y[i * size:(i + 1) * size])
                  for i in range(MICROBATCHES * DP)]
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def train_3d(rank: int, world: int, wrap: str, schedule: str = "1F1B") -> dict[str, torch.Tensor]:
    """This rank's stages after STEPS steps of `schedule` (1F1B: one stage per rank;
    ZBVZeroBubble: two, V-shaped), gathered whole (over dp and tp) by torch's full state dict,
    under the whole model's keys."""
    from torch.distributed import pipelining
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from overlap import ShardedModule, fully_shard

    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    v_shaped = schedule != "1F1B"
    stage_count = 2 * PP if v_shaped else PP
    per_stage = LAYERS // stage_count
    model = list(_model())
    stages, wrapped = [], {}
    for index in ([pp_rank, stage_count - 1 - pp_rank] if v_shaped else [pp_rank]):
        stage_module = nn.Sequential(*model[index * per_stage:(index + 1) * per_stage])
        for block in stage_module:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if wrap == "fully_shard":
            for block in stage_module:
                fully_shard(block, mesh=mesh["dp"])
            sharded = fully_shard(stage_module, mesh=mesh["dp"])
        else:
            sharded = ShardedModule(stage_module, mesh=mesh["dp"])
        wrapped[index] = sharded
        stages.append(PipelineStage(sharded, index, stage_count, torch.device("cpu"), group=mesh["pp"].get_group()))
    runner = getattr(pipelining, f"Schedule{schedule}")(stages if v_shaped else stages[0],
                                                         n_microbatches=MICROBATCHES, loss_fn=_loss)
    optimizer = torch.optim.SGD([p for sharded in wrapped.values() for p in sharded.parameters()], lr=0.1)
    rows = slice(dp_rank * PER_DP_RANK, (dp_rank + 1) * PER_DP_RANK)
    first, last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
    for x, y in _batches():
        runner.step(*((x[rows],) if first else ()), **({"target": y[rows]} if last else {}))
        optimizer.step()
        optimizer.zero_grad()
    out = {}
    for index, sharded in wrapped.items():
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        out.update({f"{index * per_stage + int(key.split('.', 1)[0])}.{key.split('.', 1)[1]}": value
                    for key, value in full.items()})
    return out


@pytest.fixture(scope="module")
def launch() -> CaseLaunch:
    return CaseLaunch({f"{wrap}:{schedule}": RankCase(train_3d, (wrap, schedule))
                       for wrap in ("sharded", "fully_shard") for schedule in SCHEDULES},
                      world_size=PP * DP * TP, timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("wrap", ("sharded", "fully_shard"))
def test_pp_dp_tp_trains_like_one_process(launch: CaseLaunch, wrap: str, schedule: str) -> None:
    reference = _one_process()
    for outcome in launch[f"{wrap}:{schedule}"]:
        result = outcome.result()
        # Each rank holds its own stages' half of the model, every tensor whole.
        assert len(result) == len(reference) // PP
        for key, value in result.items():
            assert not value.isnan().any(), key
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
