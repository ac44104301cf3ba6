"""Streaming pretrained weights from safetensors into meta-built sharded models."""
from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch

from distributed import CaseLaunch, RankCase
from parity_cases import _hf_gpt2, _hf_llama

TOKENS = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(7))
BUILDERS = {"gpt2": _hf_gpt2, "llama": _hf_llama}


@functools.lru_cache(maxsize=None)
def _saved(directory: str) -> dict:
    """Both models saved with save_pretrained (Llama in several shards, with an index), and
    the logits of each loaded back by from_pretrained."""
    from transformers import AutoModelForCausalLM

    logits = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(3)
        build().save_pretrained(f"{directory}/{name}", max_shard_size="20KB" if name == "llama" else "5GB")
        with torch.no_grad():
            logits[name] = AutoModelForCausalLM.from_pretrained(f"{directory}/{name}")(input_ids=TOKENS).logits
    return logits


def _load_on_meta(rank: int, world: int, directory: str) -> dict:
    from overlap import ShardedModule
    from overlap.checkpoint import load_pretrained

    logits = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
        sharded = ShardedModule(model, param_init_fn=model._init_weights)
        load_pretrained(sharded, f"{directory}/{name}")
        with torch.no_grad():
            logits[name] = sharded(input_ids=TOKENS).logits
    return logits


BROKEN = [
    ("drop", "has no 'transformer.h.1.mlp.c_fc.weight'"),
    ("add", "holds 'transformer.h.9.extra', which the model does not have"),
    ("reshape", "'transformer.wpe.weight' has shape (8, 32) in"),
]


def _save_broken(directory: str, change: str) -> str:
    """GPT-2's saved file with one key dropped, added or reshaped."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{directory}/gpt2/model.safetensors")
    if change == "drop":
        del tensors["transformer.h.1.mlp.c_fc.weight"]
    elif change == "add":
        tensors["transformer.h.9.extra"] = torch.zeros(3)
    else:
        tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:8].clone()
    path = f"{directory}/broken-{change}.safetensors"
    save_file(tensors, path)
    return path


def _load_broken(rank: int, world: int, path: str) -> None:
    from overlap import ShardedModule
    from overlap.checkpoint import load_pretrained

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _hf_gpt2()
    load_pretrained(ShardedModule(model, param_init_fn=model._init_weights), path)


class Saved(NamedTuple):
    directory: str
    logits: dict                        # from_pretrained's, per model
    launches: dict[int, CaseLaunch]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """The saved models, their logits, and one launch per world size running its cases in
    turn (tests/distributed.py's [Note: many cases on one launch])."""
    directory = str(tmp_path_factory.mktemp("pretrained"))
    logits = _saved(directory)
    broken = {f"broken-{change}": RankCase(_load_broken, (_save_broken(directory, change),)) for change, _ in BROKEN}
    launches = {world: CaseLaunch({"load": RankCase(_load_on_meta, (directory,)), **(broken if world == 2 else {})},
                                  world_size=world, timeout=500)
                for world in (1, 2, 3)}
    return Saved(directory, logits, launches)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_weights_give_from_pretrained_logits(world: int, saved: Saved) -> None:
    import os

    assert os.path.isfile(f"{saved.directory}/llama/model.safetensors.index.json")     # the sharded form is covered
    for logits in (outcome.result() for outcome in saved.launches[world]["load"]):
        for name, value in saved.logits.items():
            torch.testing.assert_close(logits[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("change,expected", BROKEN)
def test_bad_files_are_an_error_naming_the_key_on_every_rank(change: str, expected: str, saved: Saved) -> None:
    errors = [outcome.error() for outcome in saved.launches[2][f"broken-{change}"]]
    assert all(expected in error for error in errors), errors[0][:300]
