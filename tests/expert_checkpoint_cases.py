"""Rank-side cases of tests/test_expert_parallel.py for checkpoints under expert parallelism: a
model trained one AdamW step at one expert-parallel size, saved with torch.distributed.checkpoint
(torch's state-dict API, as torchtitan saves) and with overlap.checkpoint, loaded at the same
size, at another and without expert parallelism, and converted to one process's file."""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch

# (expert-parallel size saved at, the sizes it is loaded at; None: without expert parallelism)
Plan = tuple[tuple[int, tuple[Optional[int], ...]], ...]


def _largest_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    if set(got) != set(want):
        return float("inf")
    return max(float((got[key].float() - value.float()).abs().max()) for key, value in want.items())


def _optimizer_difference(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest difference of any state tensor of two full optimizer state dicts."""
    if set(got["state"]) != set(want["state"]):
        return float("inf")
    return max(_largest_difference({k: torch.as_tensor(v) for k, v in got["state"][n].items()},
                                   {k: torch.as_tensor(v) for k, v in want["state"][n].items()})
               for n in want["state"])


def _built(rank: int, world: int, ep: Optional[int], seed: int, steps: int,
           wrapper: str) -> tuple[Any, torch.optim.Optimizer]:
    """The model wrapped (`ShardedModule`, or `fully_shard` on blocks then the root) and its
    AdamW after `steps` steps."""
    from overlap import ShardedModule
    from test_expert_parallel import PER_RANK, _batches, _fully_shard, _gpt_moe, _loss

    torch.manual_seed(seed)
    if wrapper == "sharded":
        model = ShardedModule(_gpt_moe(seed), expert_parallel=ep)
    else:
        model = _gpt_moe(seed)
        _fully_shard(model, "gpt_moe", ep, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches(world)[:steps]:
        _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK],
              "gpt_moe").backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _runtime(model: Any) -> Any:
    """The ShardedModule that runs `model` (itself, or `fully_shard`'s)."""
    return getattr(model, "overlap_runtime", model)


def round_trips(rank: int, world: int, where: str, plan: Plan, wrapper: str) -> dict:
    """For each saved size: the largest difference between the saved model's full state (and
    full optimizer state) and what each load gives back: through torch's API and DCP, through
    overlap.checkpoint, through torch's full state dicts (set from every rank's copy), torch's
    full state dict itself, and the one-process file on rank 0; "moved": how far the model
    loaded into was before (so a load that did nothing fails)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    import overlap.checkpoint

    out: dict = {}
    for ep, targets in plan:
        model, optimizer = _built(rank, world, ep, seed=0, steps=1, wrapper=wrapper)
        full, full_optim = _runtime(model).full_state_dict(), _runtime(model).full_optim_state_dict(optimizer)
        whole_options = StateDictOptions(full_state_dict=True)
        whole = get_model_state_dict(model, options=whole_options)
        whole_optim = get_optimizer_state_dict(model, optimizer, options=whole_options)
        out[(ep, "torch full state dict")] = _largest_difference(whole, full)
        path = os.path.join(where, f"ep{ep}")
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=path)
        # overlap.checkpoint holds ShardedModule's optimizer state; fully_shard's goes through DCP.
        ours = wrapper == "sharded"
        if ours:
            overlap.checkpoint.save(path + "-overlap", model, optimizer)
        else:
            try:
                overlap.checkpoint.save(path + "-overlap", _runtime(model), optimizer)
                out[(ep, "overlap.checkpoint refused")] = "saved"
            except TypeError as error:
                out[(ep, "overlap.checkpoint refused")] = str(error)
        for target in targets:
            built, _ = _built(rank, world, target, seed=1, steps=0, wrapper=wrapper)
            other = _runtime(built)               # its full state, read back by the runtime
            before = other.full_state_dict()
            out[(ep, target, "moved")] = _largest_difference(before, full)
            other_optimizer = torch.optim.AdamW(built.parameters(), lr=1e-2)
            state = {"model": get_model_state_dict(built),
                     "optimizer": get_optimizer_state_dict(built, other_optimizer)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(built, state["model"])
            set_optimizer_state_dict(built, other_optimizer, state["optimizer"])
            out[(ep, target, "dcp")] = (_largest_difference(other.full_state_dict(), full),
                                        _optimizer_difference(other.full_optim_state_dict(other_optimizer), full_optim))
            if ours:
                other.load_full_state_dict(before)
                other_optimizer = torch.optim.AdamW(built.parameters(), lr=1e-2)
                overlap.checkpoint.load(path + "-overlap", other, other_optimizer)
                out[(ep, target, "overlap.checkpoint")] = (
                    _largest_difference(other.full_state_dict(), full),
                    _optimizer_difference(other.full_optim_state_dict(other_optimizer), full_optim))
            other.load_full_state_dict(before)
            other_optimizer = torch.optim.AdamW(built.parameters(), lr=1e-2)
            set_model_state_dict(built, copy.deepcopy(whole), options=whole_options)
            set_optimizer_state_dict(built, other_optimizer, copy.deepcopy(whole_optim), options=whole_options)
            out[(ep, target, "torch full state")] = (
                _largest_difference(other.full_state_dict(), full),
                _optimizer_difference(other.full_optim_state_dict(other_optimizer), full_optim))
        if rank == 0:
            dcp_to_torch_save(path, path + ".pt")
            converted = torch.load(path + ".pt", weights_only=False)["model"]
            out[(ep, "one process")] = _largest_difference(converted, full)
        dist.barrier()
    return out
