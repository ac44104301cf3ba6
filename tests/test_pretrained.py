"""Streaming pretrained weights from safetensors into meta-built sharded models."""
from __future__ import annotations

import functools

import pytest
import torch

from distributed import RankError, run_distributed
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


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    directory = str(tmp_path_factory.mktemp("pretrained"))
    return directory, _saved(directory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_weights_give_from_pretrained_logits(world: int, saved) -> None:
    import os

    directory, expected = saved
    assert os.path.isfile(f"{directory}/llama/model.safetensors.index.json")       # the sharded form is covered
    for logits in run_distributed(_load_on_meta, world, directory):
        for name, value in expected.items():
            torch.testing.assert_close(logits[name], value, rtol=1e-5, atol=1e-5)


def _load_broken(rank: int, world: int, path: str) -> None:
    from overlap import ShardedModule
    from overlap.checkpoint import load_pretrained

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _hf_gpt2()
    load_pretrained(ShardedModule(model, param_init_fn=model._init_weights), path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change,expected", [
    ("drop", "has no 'transformer.h.1.mlp.c_fc.weight'"),
    ("add", "holds 'transformer.h.9.extra', which the model does not have"),
    ("reshape", "'transformer.wpe.weight' has shape (8, 32) in"),
])
def test_bad_files_are_an_error_naming_the_key_on_every_rank(change: str, expected: str, saved, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    directory, _ = saved
    tensors = load_file(f"{directory}/gpt2/model.safetensors")
    if change == "drop":
        del tensors["transformer.h.1.mlp.c_fc.weight"]
    elif change == "add":
        tensors["transformer.h.9.extra"] = torch.zeros(3)
    else:
        tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:8].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(RankError) as info:
        run_distributed(_load_broken, 2, str(tmp_path / "model.safetensors"))
    assert set(info.value.errors) == {0, 1}
    assert all(expected in error for error in info.value.errors.values()), info.value.errors[0][:300]
