"""Models built on the meta device: materialised module by module from rank 0's generator
state, the same at every world size and the same as eager construction however the ranks
were seeded; clear errors when something stays uninitialised."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import CaseLaunch, RankCase
from models import Block, Tiny
from parity_cases import SMALL_GPT


def _meta_gpt_state(rank: int, world: int, seed_of_rank: tuple[int, ...] = (0, 0, 0)) -> dict:
    from overlap import ShardedModule
    from overlap.models import GPT

    torch.manual_seed(seed_of_rank[rank])
    with torch.device("meta"):
        model = GPT(SMALL_GPT)
    state = ShardedModule(model).full_state_dict()
    # Materialising left this rank's own generator as it was.
    after = torch.rand(4)
    torch.manual_seed(seed_of_rank[rank])
    return {"state": state, "own_generator_kept": torch.equal(after, torch.rand(4))}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_meta_gpt_equals_eager_construction_at_any_world_size(world: int) -> None:
    from overlap.models import GPT

    torch.manual_seed(0)
    eager = GPT(SMALL_GPT).state_dict()
    for outcome in LAUNCHES[world]["gpt"]:
        result = outcome.result()
        state = result["state"]
        assert list(state) == list(eager)
        for key, value in eager.items():
            assert torch.equal(state[key], value), key
    torch.manual_seed(1)
    assert not torch.equal(GPT(SMALL_GPT).state_dict()["blocks.0.fc.weight"], eager["blocks.0.fc.weight"])


@pytest.mark.timeout(600)
def test_ranks_seeded_differently_materialise_rank_0s_model() -> None:
    from overlap.models import GPT

    torch.manual_seed(DIFFERENT_SEEDS[0])
    eager = GPT(SMALL_GPT).state_dict()
    for outcome in LAUNCHES[3]["gpt-seeded-by-rank"]:
        result = outcome.result()
        assert result["own_generator_kept"]
        for key, value in eager.items():
            assert torch.equal(result["state"][key], value), key


class _WithRawParameter(nn.Module):
    """A unit holding a raw nn.Parameter (no reset_parameters) and a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(6, 8)
        self.tiny = Tiny(6)
        self.register_buffer("scale", torch.full((6,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiny(self.block(x)) * self.scale


def _init_tiny_and_scale(module: nn.Module) -> None:
    if isinstance(module, Tiny):
        nn.init.ones_(module.gain)
        nn.init.zeros_(module.bias)
    elif isinstance(module, _WithRawParameter):
        module.scale.fill_(2.0)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _init_from_the_rank(module: nn.Module) -> None:
    """Draws from a generator of its own, seeded by the rank: the values differ between ranks."""
    import torch.distributed as dist

    if isinstance(module, Tiny):
        generator = torch.Generator().manual_seed(dist.get_rank())
        module.gain.copy_(torch.rand(module.gain.shape, generator=generator))
        nn.init.zeros_(module.bias)
    else:
        _init_tiny_and_scale(module)


def _wrap_meta(rank: int, world: int, init: str) -> dict:
    from overlap import ShardedModule

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _WithRawParameter()
    init_fn = {"none": None, "full": _init_tiny_and_scale, "partial": lambda m: None,
               "by_rank": _init_from_the_rank}[init]
    wrapped = ShardedModule(model, unit_types=(Block, Tiny), param_init_fn=init_fn)
    torch.manual_seed(0)
    x = torch.randn(2, 6)
    with torch.no_grad():
        return {"out": wrapped(x), "state": wrapped.full_state_dict()}


def _eager_reference() -> dict:
    torch.manual_seed(0)
    model = _WithRawParameter()
    torch.manual_seed(0)
    x = torch.randn(2, 6)
    with torch.no_grad():
        return {"out": model(x), "state": model.state_dict()}


# One launch per world size, its cases in turn (tests/distributed.py's [Note: many cases on one launch]).
DIFFERENT_SEEDS = (7, 8, 9)
LAUNCHES = {
    1: CaseLaunch({"gpt": RankCase(_meta_gpt_state)}, world_size=1),
    2: CaseLaunch({"gpt": RankCase(_meta_gpt_state),
                   **{f"init-{init}": RankCase(_wrap_meta, (init,)) for init in ("full", "none", "partial", "by_rank")}},
                  world_size=2),
    3: CaseLaunch({"gpt": RankCase(_meta_gpt_state), "gpt-seeded-by-rank": RankCase(_meta_gpt_state, (DIFFERENT_SEEDS,))},
                  world_size=3),
}


@pytest.mark.timeout(600)
def test_param_init_fn_initialises_what_reset_parameters_cannot() -> None:
    reference = _eager_reference()
    for outcome in LAUNCHES[2]["init-full"]:
        result = outcome.result()
        torch.testing.assert_close(result["out"], reference["out"])
        for key, value in reference["state"].items():
            assert torch.equal(result["state"][key], value), key


@pytest.mark.timeout(600)
@pytest.mark.parametrize("init,expected", [
    ("none", "<root> (_WithRawParameter) has parameters or buffers on the meta device and no reset_parameters()"),
    ("partial", "is still uninitialised after param_init_fn ran on"),
])
def test_uninitialised_parameters_are_an_error_on_every_rank(init: str, expected: str) -> None:
    assert all(expected in outcome.error() for outcome in LAUNCHES[2][f"init-{init}"])


@pytest.mark.timeout(600)
def test_an_init_that_differs_between_ranks_is_an_error_on_every_rank() -> None:
    assert all("ranks initialised tiny.gain differently" in e and "rank 0's torch generator state" in e
               for e in (outcome.error() for outcome in LAUNCHES[2]["init-by_rank"]))
