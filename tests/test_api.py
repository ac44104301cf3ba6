"""The wrapper's surface: attribute fall-through, parameters, modes, nesting."""
from __future__ import annotations

import pytest
from torch import nn

from distributed import CaseLaunch, RankCase


def _surface(rank: int, world: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from torch.distributed.fsdp import FSDPModule

    from overlap import ShardedModule

    inner = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    reference = GPT2LMHeadModel(inner.config)
    model = ShardedModule(inner)
    names = [name for name, _ in model.named_parameters()]
    shards = list(model.parameters())
    model.eval()
    eval_modes = {m.training for m in inner.modules()}
    model.train()
    return {
        "module_is_inner": model.module is inner,
        "config_vocab": model.config.vocab_size,
        "same_objects": [id(p) for p in inner.parameters()] == [id(p) for p in shards],
        "names": names,
        "reference_names": [name for name, _ in reference.named_parameters()],
        "own_dims": all(isinstance(p, nn.Parameter) and p.dim() == max(full.dim(), 1) and p.shape[1:] == full.shape[1:]
                        for p, full in zip(shards, reference.parameters())),
        "part_sizes": [p.numel() for p in shards],
        "full_sizes": [p.numel() for p in reference.parameters()],
        "eval_modes": eval_modes,
        "train_modes": {m.training for m in inner.modules()},
        # Only a pipeline stage's ShardedModule passes for an FSDPModule (tests/test_pipeline.py):
        # libraries that branch on FSDP2 leave the others alone.
        "fsdp_module": isinstance(model, FSDPModule),
    }


def _nested(rank: int, world: int) -> None:
    from overlap import ShardedModule

    inner = ShardedModule(nn.Linear(3, 3))
    ShardedModule(nn.Sequential(inner, nn.Linear(3, 1)))


# Both cases on the same two ranks (tests/distributed.py's [Note: many cases on one launch]).
LAUNCH = CaseLaunch({"surface": RankCase(_surface), "nested": RankCase(_nested)}, world_size=2)


@pytest.mark.timeout(300)
def test_wrapper_surface() -> None:
    results = [outcome.result() for outcome in LAUNCH["surface"]]
    for result in results:
        assert result["module_is_inner"] and result["config_vocab"] == 61
        # The module's own parameters under their own names (the tied embedding once), each
        # holding this rank's rows with the parameter's own dimensions.
        assert result["same_objects"]
        assert result["names"] == result["reference_names"] and len(result["names"]) == len(set(result["names"]))
        assert result["own_dims"]
        assert result["eval_modes"] == {False} and result["train_modes"] == {True}
        assert not result["fsdp_module"]
    # The ranks' parts of each parameter add up to it exactly (no padding shows).
    assert [a + b for a, b in zip(results[0]["part_sizes"], results[1]["part_sizes"])] == results[0]["full_sizes"]



@pytest.mark.timeout(300)
def test_nesting_is_refused_on_every_rank() -> None:
    assert all("already contains a ShardedModule" in outcome.error() for outcome in LAUNCH["nested"])
