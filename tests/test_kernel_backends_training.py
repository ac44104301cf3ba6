"""Sharded training on 2 gloo ranks gives the same losses and final parameters, bit for bit,
whichever kernel backend moves the flat buffers (`torch` is the reference).

Two runs per backend: fp32 (in-place pre-division of gradients) and bf16 mixed precision
(fp32 -> bf16 cast of the shards, bf16 gradients divided into fp32), each with the 2-chunk
accumulation gloo's all-to-all reduction uses.
"""
from __future__ import annotations

import pytest
import torch

from compiled_extension import require_extension
from distributed import run_distributed

STEPS = 3
TIMEOUT_S = 240


def _train(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from overlap import ShardedModule
    from overlap.base.mixed_precision import MixedPrecision
    from overlap.models.gpt import GPT, GPTConfig

    results = {}
    for label, precision in (("fp32", None), ("bf16", MixedPrecision(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32))):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        model = ShardedModule(GPT(config), mixed_precision=precision)
        backend = model.collectives.kernels.name
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1 + rank)
        losses = []
        for _ in range(STEPS):
            idx = torch.randint(0, config.vocab_size, (2, config.block_size), generator=gen)
            loss = model(idx, idx.roll(-1, dims=1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        results[label] = (backend, losses, model.full_state_dict())
    return results


def _run(env: dict) -> dict:
    return run_distributed(_train, 2, env={"OMP_NUM_THREADS": "1", **env}, timeout=TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def reference() -> dict:
    return _run({"OVERLAP_KERNELS": "torch"})


def _backend_env(name: str) -> dict:
    if name == "triton":
        pytest.importorskip("triton")
        return {"OVERLAP_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    require_extension()
    return {"OVERLAP_KERNELS": "ext"}


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("name", ["triton", "ext"])
def test_training_matches_torch_backend(name, reference):
    results = _run(_backend_env(name))
    for label, (ref_backend, ref_losses, ref_state) in reference.items():
        backend, losses, state = results[label]
        assert (ref_backend, backend) == ("torch", name)
        assert losses == ref_losses, f"{label}: losses {losses} vs torch backend's {ref_losses}"
        assert state.keys() == ref_state.keys()
        for key, value in state.items():
            assert torch.equal(value, ref_state[key]), f"{label}: {key} differs from the torch backend's"
