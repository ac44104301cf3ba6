"""The memory prediction on models its rules were not derived from.

tests/test_memory_prediction.py checks the cases whose measured peaks the temporaries rule was
read from; these are other widths, depths, vocabularies, batch shapes and a Hugging Face Llama,
measured the same way (torch's MemTracker, rank 0 of 2 gloo ranks) and held to the same
per-category tolerances (`TOLERANCE`, stated in docs/memory.md). Where the prediction misses,
the case stays here as a strict expected failure with the measured gap, so a change to the rule
that fixes it must also drop the mark.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from torch import nn

from overlap.models import GPT, Block, GPTConfig
from overlap.plan.memory import ActivationShape
from overlap.plan.memory_prediction import PREDICTED_CATEGORIES, predict_memory
from distributed import run_distributed  # tests/ is on sys.path under pytest
from test_memory_prediction import TOLERANCE


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _llama_layer() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaDecoderLayer


@dataclass(frozen=True)
class HeldOut:
    name: str
    build: Callable[[], nn.Module]
    unit_type: Callable[[], type]
    vocab: int
    batch: int
    seq: int
    param_dtype: Optional[torch.dtype]
    optimizer: str
    depth: int
    hf: bool = False


def _gpt(**kwargs) -> Callable[[], nn.Module]:
    return lambda: GPT(GPTConfig(**kwargs))


CASES = [
    HeldOut("gpt-3x64-v256-bf16-adamw", _gpt(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64),
            lambda: Block, 256, 2, 32, torch.bfloat16, "adamw", 1),
    HeldOut("gpt-6x96-v512-fp32-adamw", _gpt(vocab_size=512, block_size=32, n_layer=6, n_head=3, n_embd=96),
            lambda: Block, 512, 2, 32, None, "adamw", 1),
    HeldOut("gpt-2x192-v2048-bf16-sgd-d2", _gpt(vocab_size=2048, block_size=48, n_layer=2, n_head=4, n_embd=192),
            lambda: Block, 2048, 3, 48, torch.bfloat16, "sgd-momentum", 2),
    HeldOut("gpt-8x64-v128-fp32-sgd", _gpt(vocab_size=128, block_size=64, n_layer=8, n_head=4, n_embd=64),
            lambda: Block, 128, 4, 64, None, "sgd-momentum", 1),
    HeldOut("hf-llama-3x64-v320-fp32-adamw", _llama, _llama_layer, 320, 2, 32, None, "adamw", 1, hf=True),
]


def _measure(rank: int, world: int, names: list[str]) -> dict:
    from overlap import MixedPrecision, ShardedModule
    from overlap.observe.memory import measure

    out = {}
    for case in (c for c in CASES if c.name in names):
        idx = torch.randint(0, case.vocab, (case.batch, case.seq), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        model = ShardedModule(case.build(), unit_types=[case.unit_type()], bucket_mb=1e-6, prefetch_depth=case.depth,
                              mixed_precision=MixedPrecision(param_dtype=case.param_dtype))
        optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if case.optimizer == "adamw"
                     else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=idx, labels=idx).loss if case.hf else model(idx, idx)
            loss.backward()
            optimizer.step()

        step()
        out[case.name] = measure(model, optimizer, step)
    return out


def _predict(case: HeldOut):
    model = case.build()
    hidden = model.config.hidden_size if case.hf else model.config.n_embd
    layers = model.config.num_hidden_layers if case.hf else model.config.n_layer
    heads = model.config.num_attention_heads if case.hf else model.config.n_head
    shape = ActivationShape(batch=case.batch, seq=case.seq, hidden=hidden, layers=layers, heads=heads, vocab=case.vocab)
    return predict_memory(model, 2, unit_types=case.unit_type(), prefetch_depth=case.depth,
                          param_dtype=case.param_dtype, optimizer=case.optimizer, activations=shape)


@functools.lru_cache(maxsize=None)
def _measured() -> dict:
    return run_distributed(_measure, 2, [c.name for c in CASES], env={"OMP_NUM_THREADS": "1"}, timeout=280)[0]


# (case, category) -> why the prediction misses it beyond the tolerance (docs/memory.md).
MISSES = {
    ("gpt-3x64-v256-bf16-adamw", "temporaries"): "measured 11.6% above: a buffer the rule does not name "
                                                 "(small width against batch x sequence)",
    ("gpt-8x64-v128-fp32-sgd", "temporaries"): "measured 21.2% above: as above, with 8 layers of width 64",
    ("hf-llama-3x64-v320-fp32-adamw", "temporaries"): "measured 9.9% below: the rule's terms are the GPT block's",
    ("hf-llama-3x64-v320-fp32-adamw", "activations"): "measured 22% above: the layer formula is the GPT block's "
                                                      "(LayerNorm, a 4h GELU MLP), not Llama's",
}


def _params() -> list:
    return [pytest.param(case.name, category, id=f"{case.name}-{category}",
                         marks=[pytest.mark.xfail(strict=True, reason=MISSES[case.name, category])]
                         if (case.name, category) in MISSES else [])
            for case in CASES for category in PREDICTED_CATEGORIES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, category", _params())
def test_prediction_on_a_model_it_was_not_derived_from(name: str, category: str) -> None:
    case = next(c for c in CASES if c.name == name)
    estimate, actual = getattr(_predict(case), category), getattr(_measured()[name], category)
    print(f"{name} {category}: predicted {estimate:.0f} B, measured {actual:.0f} B, ratio {actual / estimate:.3f}")
    assert actual == pytest.approx(estimate, rel=TOLERANCE[category], abs=0)
