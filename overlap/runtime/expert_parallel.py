"""Expert parallelism under ZeRO-3: each MoE layer's experts split across groups of E ranks,
tokens sent to the rank that owns their expert and back by all-to-all.

[Note: expert parallelism's groups]
Ranks r = g·E + e form the expert-parallel group g (E consecutive ranks: the all-to-all stays
inside a node where E divides the node's size) and the expert-sharding group e (the world/E
ranks holding the same experts, one in each expert-parallel group). Rank r keeps experts
[e·n/E, (e+1)·n/E) of each layer's n; those parameters are ZeRO-3-sharded over its
expert-sharding group, every other parameter over all ranks (torchtitan's "efsdp" and "dp"
meshes). Every element of every expert lives on exactly one rank, so norms summed over all
ranks count each once. Each rank's loss covers its own tokens; a local expert's gradient sums
what the tokens of its expert-parallel group sent it, and the reduction over its
expert-sharding group adds the other groups' tokens: the sum over all ranks' losses, divided by
the world size as every other parameter's (DDP's mean).

[Note: dispatch behind compute]
A layer's token-expert pairs, sorted by expert, are split into two halves, each with its own
dispatch and combine on its own copy of the expert-parallel group. Both halves' dispatches are
issued before any expert computes, so the second half's all-to-all runs while the first half's
experts compute, and the first half's combine while the second half's compute (dual-batch
overlap: gloo's work runs on its own threads, NCCL's on its own stream). The two groups keep
each half's collectives in one order on every rank whatever order autograd runs the halves'
backwards in, and those backwards wait for their all-to-all.

[Note: ranks that part in a mixture of experts]
A rank that runs another number of MoE layers than the others (a layer skipped under a
condition) would leave its expert-parallel peers in an all-to-all no other rank joins, where
gloo waits out the group's timeout. Each layer's all-to-alls therefore go through the order
check the other collectives use (overlap/runtime/order_check.py): its word before the count
exchange where ranks could part, and every wait watched, so that a wait past a few seconds
compares the units each rank ran and raises DivergenceError on every rank.

[Note: routing that cannot hang]
Each layer's dispatch is two all-to-alls over the expert-parallel group, issued by every rank
whatever its routing: first the pair counts (one int per rank), then the tokens with those
counts as uneven splits, zero where a rank sends or receives nothing. A rank with no tokens at
all, an expert no token chose and every token on one expert all take the same calls. The
combine is the dispatch's reverse, and autograd runs both backwards in the same order on every
rank: a rank whose experts got no token keeps both in its graph with zero terms, and gives its
experts a zero gradient, so the reductions over the ranks holding the same experts match
too. Nothing is kept between calls, so a recompute under activation checkpointing or another
microbatch in flight reissues its own.
"""
from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from overlap.runtime.pending import wait_watched

# Expert modules recognised by class name: Hugging Face's (transformers 5 layout: 3-D expert
# weights, forward(hidden_states, top_k_index, top_k_weights)) and overlap.models.moe's.
EXPERT_CLASS_NAMES = ("Experts", "Qwen3MoeExperts", "Qwen2MoeExperts", "MixtralExperts", "OlmoeExperts",
                      "GptOssExperts", "DeepseekV3NaiveMoe", "Qwen3NextExperts")


class _Watched:
    """The runtime's collectives, whose order check (`watch`) the all-to-alls go through; set
    once the runtime is built, before the first forward."""

    collectives: Any = None

    @property
    def check(self) -> Any:
        return None if self.collectives is None else self.collectives.watch


@dataclass(frozen=True)
class ExpertGroups:
    size: int                                # E, ranks per expert-parallel group
    # This rank's expert-parallel group, twice: one for each half of a layer's tokens (see
    # [Note: dispatch behind compute]).
    ep_groups: tuple[dist.ProcessGroup, dist.ProcessGroup]
    shard_group: dist.ProcessGroup           # the ranks holding this rank's experts
    ep_rank: int
    ranks: tuple[int, ...]                   # the world's ranks in order: rank g·E + e is ranks[g·E + e]
    # See [Note: ranks that part in a mixture of experts].
    watched: _Watched = field(default_factory=_Watched)


def expert_modules(module: nn.Module, named: Sequence[type] = ()) -> list[nn.Module]:
    """The expert modules of `module`, in module order: those of a recognised class or of a
    class in `named`."""
    return [m for m in module.modules()
            if (type(m).__name__ in EXPERT_CLASS_NAMES or isinstance(m, tuple(named))) and hasattr(m, "num_experts")]


def make_groups(size: int, all_group: dist.ProcessGroup) -> ExpertGroups:
    """Both families of groups (see the note); every rank calls it, creating every group."""
    world, rank = dist.get_world_size(all_group), dist.get_rank(all_group)
    if size < 1 or world % size:
        raise ValueError(f"expert_parallel={size} must divide the world size {world}")
    ranks = dist.get_process_group_ranks(all_group)
    ep_groups = shard_group = None
    for g in range(world // size):
        members = [ranks[g * size + e] for e in range(size)]
        made = (dist.new_group(members), dist.new_group(members))
        if rank // size == g:
            ep_groups = made
    for e in range(size):
        members = [ranks[g * size + e] for g in range(world // size)]
        made = dist.new_group(members)
        if rank % size == e:
            shard_group = made
    return ExpertGroups(size, ep_groups, shard_group, rank % size, tuple(ranks))


def split_experts(modules: list[nn.Module], groups: ExpertGroups) -> None:
    """Keep this rank's experts of each module and route its calls through the all-to-all."""
    for number, module in enumerate(modules):
        total = int(module.num_experts)
        if total % groups.size:
            raise ValueError(f"expert_parallel={groups.size} must divide the number of experts, {total}, "
                             f"of {type(module).__name__}")
        local = total // groups.size
        first = groups.ep_rank * local
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 or param.shape[0] != total:
                raise ValueError(f"{type(module).__name__}.{name} of shape {tuple(param.shape)} is not one row per "
                                 f"expert ({total}): expert parallelism cannot split it")
            # The same Parameter object, holding this rank's experts: an optimizer built before
            # wrapping keeps stepping it (parameters keep their identity).
            param.data = param.data[first:first + local].clone()
        module.num_experts = local
        module.forward = types.MethodType(_dispatched(type(module).forward, total, local, groups,
                                                      f"experts {number}"), module)


class _AllToAll(torch.autograd.Function):
    """Rows of `rows` sent in `send_sizes` to each rank of `group`, `received_sizes` from each,
    issued without waiting: the work and the rows it reads are appended to `pending`, and the
    caller waits before reading the result. Backward sends the gradients back the same way
    and waits, watched by `watched`'s order check."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, received_sizes: list[int], send_sizes: list[int],
                group: dist.ProcessGroup, pending: list, watched: _Watched) -> torch.Tensor:
        ctx.sizes, ctx.group, ctx.watched = (received_sizes, send_sizes), group, watched
        out = rows.new_empty((sum(received_sizes), *rows.shape[1:]))
        rows = rows.contiguous()
        pending.append((dist.all_to_all_single(out, rows, received_sizes, send_sizes, group=group, async_op=True),
                        rows))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        received_sizes, send_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        grad = grad.contiguous()
        _wait([(dist.all_to_all_single(out, grad, send_sizes, received_sizes, group=ctx.group, async_op=True),
                grad)], ctx.watched.check)
        return out, None, None, None, None, None


def _wait(pending: list, check: Any = None) -> None:
    """Wait for each pending all-to-all; with the order check `check`, a wait that lasts
    looks for ranks that parted (see [Note: ranks that part in a mixture of experts])."""
    for work, _ in pending:
        if check is None:
            work.wait()
            continue
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _future, done=finished: done.set())
        wait_watched(work, check, finished.is_set, finished.wait)
    pending.clear()


def _dispatched(compute: Callable[..., torch.Tensor], total: int, local: int, groups: ExpertGroups,
                label: str) -> Callable:
    """The expert module's forward over all `total` experts: each token-expert pair goes to the
    rank owning the expert, `compute` (the module's own forward over its `local` experts) runs
    there, and the results come back weighted (see [Note: routing that cannot hang] and [Note:
    dispatch behind compute])."""
    size = groups.size

    def forward(self: nn.Module, hidden_ND: torch.Tensor, top_k_index_NK: torch.Tensor,
                top_k_weights_NK: torch.Tensor) -> torch.Tensor:
        N = hidden_ND.shape[0]
        expert_P = top_k_index_NK.reshape(-1)
        token_P = torch.arange(N, device=hidden_ND.device).repeat_interleave(top_k_index_NK.shape[1])
        weight_P = top_k_weights_NK.reshape(-1)
        kept = expert_P < total                       # an index of `total` or more is a dropped choice
        order = torch.argsort(torch.where(kept, expert_P, total), stable=True)[:int(kept.sum())]
        expert_P, token_P, weight_P = expert_P[order], token_P[order], weight_P[order]
        owner_P = torch.div(expert_P, local, rounding_mode="floor")
        halves = (slice(0, len(expert_P) // 2), slice(len(expert_P) // 2, len(expert_P)))
        # Pairs per owner rank, each half a column; one exchange carries both.
        send = torch.stack([torch.bincount(owner_P[h], minlength=size) for h in halves], 1).to(torch.int64).cpu()
        received = torch.empty_like(send)
        check = groups.watched.check
        if check is not None:
            check.before_issue("all_to_all", label, 0)     # the sizes differ between ranks: not in the word
        _wait([(dist.all_to_all_single(received, send, group=groups.ep_groups[0], async_op=True), send)], check)
        sizes = [(received[:, c].tolist(), send[:, c].tolist()) for c in range(2)]
        dispatches, experts_M = [[], []], []
        tokens = []
        for c, half in enumerate(halves):                      # both halves' dispatch in flight
            received_sizes, send_sizes = sizes[c]
            experts_M.append(torch.empty(sum(received_sizes), dtype=torch.int64, device=hidden_ND.device))
            ids = (expert_P[half] - owner_P[half] * local).contiguous()
            dispatches[c].append((dist.all_to_all_single(experts_M[c], ids, received_sizes, send_sizes,
                                                         group=groups.ep_groups[c], async_op=True), ids))
            tokens.append(_AllToAll.apply(hidden_ND[token_P[half]], received_sizes, send_sizes, groups.ep_groups[c],
                                          dispatches[c], groups.watched))
        combines: list = []
        backs = []
        for c in range(2):                                     # half 1 arrives while half 0 computes
            _wait(dispatches[c], check)
            ones_M1 = torch.ones(len(experts_M[c]), 1, dtype=hidden_ND.dtype, device=hidden_ND.device)
            out_MD = compute(self, tokens[c], experts_M[c][:, None], ones_M1)
            if len(experts_M[c]) == 0 and torch.is_grad_enabled():
                # No token of this half reached this rank's experts: zero terms keep it in the
                # dispatch's backward all-to-all and give its experts the (zero) gradient whose
                # reduction the ranks holding the same experts issue.
                touched = sum(param.reshape(-1)[:1].sum() for param in self.parameters(recurse=False))
                out_MD = out_MD + (tokens[c].sum() + touched) * 0
            received_sizes, send_sizes = sizes[c]
            backs.append(_AllToAll.apply(out_MD, send_sizes, received_sizes, groups.ep_groups[c], combines,
                                         groups.watched))
        _wait(combines, check)
        back_PD = torch.cat(backs)
        return torch.zeros_like(hidden_ND).index_add(0, token_P, back_PD * weight_P[:, None].to(back_PD.dtype))

    return forward


def all_experts(mine: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """A parameter of this rank's experts (one row each) joined with the other expert-parallel
    ranks' into the parameter of every expert (a collective over the expert-parallel group)."""
    parts = [torch.empty_like(mine) for _ in range(groups.size)]
    dist.all_gather(parts, mine.contiguous(), group=groups.ep_groups[0])
    return torch.cat(parts)


def my_experts(whole: torch.Tensor, groups: ExpertGroups, what: str) -> torch.Tensor:
    """This rank's experts' rows of a parameter of every expert (the reverse of `all_experts`)."""
    if whole.dim() == 0 or whole.shape[0] % groups.size:
        raise ValueError(f"{what} has shape {tuple(whole.shape)}: expected one row per expert, a multiple of "
                         f"expert_parallel={groups.size}")
    local = whole.shape[0] // groups.size
    return whole[groups.ep_rank * local:(groups.ep_rank + 1) * local]


def units_with_experts(module: nn.Module, unit_modules: list[list[nn.Module]],
                       experts: list[nn.Module]) -> tuple[tuple[nn.Module, ...], ...]:
    """The units as groups of modules, each expert module a unit of its own (inside its block's
    unit), in module order: an expert unit's parameters shard over another group."""
    first = {id(group[0]): tuple(group) for group in unit_modules}
    first.update({id(m): (m,) for m in experts})
    return tuple(first[id(m)] for m in module.modules() if id(m) in first)


def expert_collectives(collectives: Any, groups: ExpertGroups, all_group: dist.ProcessGroup) -> Any:
    """Collectives over this rank's expert-sharding group, dividing the summed gradients by
    the world size and combining norms over every rank (see [Note: expert parallelism's
    groups]), logging with `collectives`."""
    made = type(collectives)(groups.shard_group, collectives.device, collectives.kernels, None, all_group)
    made.gradient_divide_factor = float(dist.get_world_size(all_group))
    made.log = collectives.log
    made.norm_collectives = collectives           # every element of every expert on one rank of the world
    return made


def expert_parallel_error(size: Optional[int], config: Any, request: Any) -> Optional[str]:
    """Why `expert_parallel=size` cannot run with the rest of the request, or None."""
    if size is None:
        return None
    if config.sharding == "hpz":
        # A node copy holds a node's ranks' rows of one shard group; an expert unit's shard group
        # is the ranks holding the same experts, which a node does not hold together.
        return ("expert_parallel with sharding='hpz' is not supported: hpZ's node copy gathers a node's ranks' "
                "rows, and an expert unit's rows lie on the ranks holding the same experts; use sharding='full' "
                "or 'hybrid'")
    refused = [(request.mesh is not None, "mesh= (tensor or pipeline parallelism)"),
               (request.dtensor_params, "fully_shard")]
    for wanted, what in refused:
        if wanted:
            return (f"expert_parallel with {what} is not supported yet: expert parallelism runs over the whole "
                    "world, without another parallel axis")
    return None
