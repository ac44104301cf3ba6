"""The parity cases: each trains identically in one process and sharded over N ranks."""
from __future__ import annotations

import torch
from torch import nn

from models import Block, FeatureNet, Reorderable, Tiny
from parity import Case, token_batches

from overlap import MixedPrecision
from overlap.models import GPT, GPTConfig

SMALL_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(batch[0], batch[1])


def _hf_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def _skip_optional_on_step_2(model: nn.Module, step: int) -> None:
    model.use_optional = step != 2


def _reverse_order_on_step_1(model: nn.Module, step: int) -> None:
    model.order = [3, 2, 1, 0] if step == 1 else [0, 1, 2, 3]


_NO_MERGING = {"unit_types": (Block, Tiny), "bucket_mb": 1e-3}
_GPT_BATCHES = token_batches(SMALL_GPT.vocab_size, 12, steps=4)

CASES = {case.name: case for case in [
    # Tied, frozen, twice-called, checkpointed, tiny and sometimes-unused parameters, an
    # exception inside a unit, and eval forwards under no_grad between steps.
    Case("features", FeatureNet, _lm_loss, token_batches(37, 6, steps=4), wrap=_NO_MERGING,
         before_step=_skip_optional_on_step_2, fail_step=1, eval_every_step=True),
    Case("features_bucketed", FeatureNet, _lm_loss, token_batches(37, 6, steps=3),
         wrap={"unit_types": (Block, Tiny), "bucket_mb": 0.01}),
    # One bucket holds the whole model, so the block skipped on step 2 shares its flat
    # buffers with parameters that do get gradients: it must get none (momentum and weight
    # decay leave it alone), as in one process.
    Case("unused_in_bucket", FeatureNet, _lm_loss, token_batches(37, 6, steps=4), optimizer="sgd_decay",
         wrap={"unit_types": (Block, Tiny), "bucket_mb": 1.0}, before_step=_skip_optional_on_step_2),
    Case("unused_in_bucket_adamw_groups", FeatureNet, _lm_loss, token_batches(37, 6, steps=4),
         optimizer="adamw_groups", wrap={"unit_types": (Block, Tiny), "bucket_mb": 1.0},
         before_step=_skip_optional_on_step_2, rtol=1e-3, atol=2e-4),
    # The units' execution order changes on one step and changes back.
    Case("order_change", Reorderable, _lm_loss, token_batches(37, 6, steps=4),
         wrap={"unit_types": (Block,), "bucket_mb": 1e-3, "prefetch_depth": 2},
         before_step=_reverse_order_on_step_1),
    Case("gpt_adamw_clip", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, optimizer="adamw", clip=0.5,
         rtol=1e-3, atol=2e-4),
    # Two optimizer groups by name (decay on matrices only, a larger learning rate elsewhere).
    Case("gpt_adamw_groups", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, optimizer="adamw_groups",
         rtol=1e-3, atol=2e-4),
    # Two groups by dimensionality (nanoGPT's `p.dim() >= 2` rule): the same groups as in one
    # process, because every part keeps its parameter's dimensions.
    Case("gpt_dim_groups", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, optimizer="adamw_dim_groups",
         rtol=1e-3, atol=2e-4),
    Case("features_dim_groups", FeatureNet, _lm_loss, token_batches(37, 6, steps=4), optimizer="adamw_dim_groups",
         wrap=_NO_MERGING, before_step=_skip_optional_on_step_2, rtol=1e-3, atol=2e-4),
    # An optimizer that reads p.shape: factored second moments over each block's rows and columns.
    Case("gpt_factored", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, optimizer="factored",
         rtol=1e-3, atol=2e-4),
    Case("gpt_no_sync", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, micro_batches=2),
    Case("gpt_no_reshard", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES,
         wrap={"reshard_after_forward": False}),
    Case("gpt_depth0", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, wrap={"prefetch_depth": 0}),
    Case("gpt_depth3", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES, wrap={"prefetch_depth": 3}),
    Case("gpt_bf16", lambda: GPT(SMALL_GPT), _lm_loss, _GPT_BATCHES,
         wrap={"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
         rtol=3e-2, atol=3e-3),
    Case("hf_gpt2", _hf_gpt2, _hf_loss, token_batches(61, 12, steps=3), optimizer="adamw",
         rtol=1e-3, atol=2e-4),
    Case("hf_llama", _hf_llama, _hf_loss, token_batches(61, 12, steps=3), optimizer="adamw",
         rtol=1e-3, atol=2e-4),
    Case("hf_llama_dim_groups", _hf_llama, _hf_loss, token_batches(61, 12, steps=3), optimizer="adamw_dim_groups",
         rtol=1e-3, atol=2e-4),
]}


def run_sharded_cases(rank: int, world: int, names: list[str]) -> dict:
    from parity import train
    return {name: train(CASES[name], rank, world, sharded=True) for name in names}
