"""The wrapper's surface: attribute fall-through, parameters, modes, nesting."""
from __future__ import annotations

import pytest
from torch import nn

from distributed import RankError, run_distributed


def _surface(rank: int, world: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from overlap import ShardedModule

    inner = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model = ShardedModule(inner)
    names = [name for name, _ in model.named_parameters()]
    shards = list(model.parameters())
    model.eval()
    eval_modes = {m.training for m in inner.modules()}
    model.train()
    return {
        "module_is_inner": model.module is inner,
        "config_vocab": model.config.vocab_size,
        "inner_params": len(list(inner.parameters())),
        "names": names,
        "all_flat_1d": all(isinstance(p, nn.Parameter) and p.dim() == 1 for p in shards),
        "shard_elements": sum(p.numel() for p in shards),
        "full_elements": sum(p.numel() for p in GPT2LMHeadModel(inner.config).parameters()),
        "eval_modes": eval_modes,
        "train_modes": {m.training for m in inner.modules()},
    }


@pytest.mark.timeout(240)
def test_wrapper_surface() -> None:
    result = run_distributed(_surface, 2)[0]
    assert result["module_is_inner"] and result["config_vocab"] == 61
    assert result["inner_params"] == 0                  # the module's parameters now live in the shards
    assert result["names"] and all(name.startswith("flat_params.") for name in result["names"])
    assert result["all_flat_1d"]
    # Each rank keeps about half of every unit's padded flat layout.
    assert result["full_elements"] / 2 <= result["shard_elements"] <= result["full_elements"] / 2 + 64
    assert result["eval_modes"] == {False} and result["train_modes"] == {True}


def _nested(rank: int, world: int) -> None:
    from overlap import ShardedModule

    inner = ShardedModule(nn.Linear(3, 3))
    ShardedModule(nn.Sequential(inner, nn.Linear(3, 1)))


@pytest.mark.timeout(240)
def test_nesting_is_refused_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        run_distributed(_nested, 2)
    assert set(info.value.errors) == {0, 1}
    assert all("already contains a ShardedModule" in e for e in info.value.errors.values())
