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
A layer's token-expert pairs are sorted by expert. The pairs whose expert is on their own rank
never travel: they are cut in two parts, one computed while the first chunk's dispatch is in
flight and one while the last chunk's combine is, the all-to-alls that would otherwise have no
compute to hide behind. The cut falls between two experts, so each expert's own pairs are one
call (on CPU an expert's weight gradient costs a pass over its weights per call). The pairs
sent to other ranks are split into C chunks (DEFAULT_CHUNKS, or OVERLAP_EXPERT_CHUNKS), each
with its own dispatch and combine on its own copy of the expert-parallel group. Every chunk's
dispatch is issued before any received token is computed, so chunk c + 1's all-to-all runs
while chunk c's experts compute, and chunk c's combine while later chunks compute (dual-batch
overlap at C = 2: gloo's work runs on its own threads, NCCL's on its own stream). More chunks
leave less exposed, at the price of smaller calls. The groups keep each chunk's collectives in
one order on every rank whatever order autograd runs the chunks' backwards in (see
[Note: backward behind compute]). Every all-to-all goes through the runtime's issue protocol
(overlap/runtime/issue.py): the step log records its time in flight and the time the caller
waited for it, which the overlap report shows on its all-to-all line.

[Note: backward behind compute]
Autograd runs a node once its gradient is complete, the most recently made first. An
all-to-all's own node, made before the expert computes, would run only after every chunk's
expert backward. So each backward all-to-all is issued by a send-back node made where the
all-to-all's result is used, and the all-to-all's own node only waits for it (a `_Handoff`
between the two, made by each forward). The join of the chunks' combined results sends every
chunk's gradient back at once; the node between a chunk's dispatched tokens and its experts
sends the tokens' gradients back as soon as that chunk's expert backward has made them.
Backward then runs, most recently made first: the second own part's backward (every chunk's
combine gradient in flight); then from the last chunk to the first: wait for the chunk's
combine gradient; its experts' backward for the tokens (the earlier chunks' combine gradients
in flight, and the later chunks' token gradients); its tokens' gradients issued; its experts'
weight gradients, behind that send ([Note: expert weight gradients after the send] in
overlap/runtime/expert_backward.py). Then the first own part's backward (the token gradients
in flight) and the waits for the token gradients. Each all-to-all sends the same rows as a
waiting backward would, so gradients are the same.

[Note: ranks that part in a mixture of experts]
A rank that runs another number of MoE layers than the others (a layer skipped under a
condition) would leave its expert-parallel peers in an all-to-all no other rank joins, where
gloo waits out the group's timeout. Each layer's all-to-alls therefore go through the order
check the other collectives use (overlap/runtime/order_check.py): its word before the count
exchange where ranks could part, and every wait watched, so that a wait past a few seconds
compares the units each rank ran and raises DivergenceError on every rank.

[Note: routing that cannot hang]
Each layer's dispatch is two all-to-alls over the expert-parallel group, issued by every rank
whatever its routing: first the pair counts (one int per chunk and expert of each receiving
rank), then the tokens with those counts as uneven splits, zero where a rank sends or receives
nothing. A rank with no tokens at all, an expert no token chose and every token on one expert
all take the same calls. The combine is the dispatch's reverse, and autograd runs both
backwards in the same order on every rank: a rank whose experts got no token keeps both in its
graph with zero terms, and gives its experts a zero gradient, so the reductions over the ranks
holding the same experts match too. Nothing is kept between calls, so a recompute under
activation checkpointing or another microbatch in flight reissues its own.

[Note: a backward split in two]
The zero-bubble pipeline schedules (and DualPipeV) split a stage's backward: an input step
(`torch.autograd.grad` over the stage's input, the graph kept), then a weight step that runs
one backward per group of parameters, from the nodes where the group's parameters join the
input's path down to the parameters. Every all-to-all lies on the input's path (tokens go out
and come back), so the input step issues each once, in the same order on every rank, and no
weight step reaches one. What it must not meet is two parameters whose paths join the
input's path at one node, unless both join it at exactly the same nodes: torch 2.13's grouping
(`get_param_groups`) merges two parameters' groups only if it meets a shared node first among
the second parameter's, else it keeps a second group that holds the node as well, whose
backward runs through it again after the first group's has freed it ("backward through the
graph a second time"). Split expert calls meet this: every parameter of the module joins the
input's path at the calls' input nodes and nowhere else. Unsplit (under saved-tensor hooks),
the zero terms of a chunk that got no token join the output one parameter at a time.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from overlap.base.expert_capacity import capacity_factor_error, drop_over_capacity
from overlap.base.step_record import ALL_TO_ALL
from overlap.runtime.expert_backward import expert_call, splits_backward
from overlap.runtime.issue import issue
from overlap.runtime.pending import Pending
from overlap.runtime.process_group import level_group_counts

# Expert modules recognised by class name: Hugging Face's (transformers 5 layout: 3-D expert
# weights, forward(hidden_states, top_k_index, top_k_weights)) and overlap.models.moe's.
# Chunks a layer's pairs are split into, each dispatched and combined on its own (see
# [Note: dispatch behind compute]).
DEFAULT_CHUNKS = 2

EXPERT_CLASS_NAMES = ("Experts", "Qwen3MoeExperts", "Qwen2MoeExperts", "MixtralExperts", "OlmoeExperts",
                      "GptOssExperts", "DeepseekV3NaiveMoe", "Qwen3NextExperts")


class _Watched:
    """The runtime's collectives, whose step log records the all-to-alls and whose order check
    (`watch`) they go through; set once the runtime is built, before the first forward."""

    collectives: Any = None

    @property
    def check(self) -> Any:
        return None if self.collectives is None else self.collectives.watch


@dataclass(frozen=True)
class ExpertGroups:
    size: int                                # E, ranks per expert-parallel group
    # This rank's expert-parallel group, once for each chunk of a layer's tokens (see
    # [Note: dispatch behind compute]).
    ep_groups: tuple[dist.ProcessGroup, ...]
    shard_group: dist.ProcessGroup           # the ranks holding this rank's experts
    ep_rank: int
    ranks: tuple[int, ...]                   # the world's ranks in order: rank g·E + e is ranks[g·E + e]
    all_group: dist.ProcessGroup             # every rank taking part: the non-expert parameters' sharding group
    # See [Note: ranks that part in a mixture of experts].
    watched: _Watched = field(default_factory=_Watched)


def expert_modules(module: nn.Module, named: Sequence[type] = ()) -> list[nn.Module]:
    """The expert modules of `module`, in module order: those of a recognised class or of a
    class in `named`."""
    return [m for m in module.modules()
            if (type(m).__name__ in EXPERT_CLASS_NAMES or isinstance(m, tuple(named))) and hasattr(m, "num_experts")]


def cap_routing(modules: list[nn.Module], capacity_factor: float) -> None:
    """Apply the expert capacity rule (see [Note: expert capacity] in
    overlap/base/expert_capacity.py) to the routing each expert module is called with, before
    its forward and so before the dispatch. Registered before the experts are split: a dropped
    pair's index is the number of every expert, which the dispatch sends nowhere."""
    for module in modules:
        total = int(module.num_experts)

        def drop(_: nn.Module, args: tuple, total: int = total) -> tuple:
            hidden_ND, top_k_index_NK, *rest = args          # Hugging Face's call: positional
            return (hidden_ND, drop_over_capacity(top_k_index_NK, total, capacity_factor), *rest)

        module.register_forward_pre_hook(drop)


def make_groups(size: int, all_group: dist.ProcessGroup, chunks: int = DEFAULT_CHUNKS,
                stage: bool = False) -> ExpertGroups:
    """Both families of groups (see the note) over the ranks of `all_group`, the
    expert-parallel one once per chunk. Every rank of the world calls it and creates every
    group, except in a pipeline stage (`stage`), whose ranks make only their own: the other
    stages' ranks may wrap other modules, without experts, at other times."""
    world, rank = dist.get_world_size(all_group), dist.get_rank(all_group)
    if size < 1 or world % size:
        raise ValueError(f"expert_parallel={size} must divide the world size {world}")
    if chunks < 1:
        raise ValueError(f"expert chunks={chunks} must be at least 1")
    ranks = dist.get_process_group_ranks(all_group)
    if stage:
        level_group_counts(all_group)

    def made(members: list[int], mine: bool) -> Optional[dist.ProcessGroup]:
        if not stage:
            return dist.new_group(members)
        # Made by its members only: see [Note: groups made by some ranks only].
        return dist.new_group(members, use_local_synchronization=True) if mine else None

    ep_groups = shard_group = None
    for g in range(world // size):
        members = [ranks[g * size + e] for e in range(size)]
        copies = tuple(made(members, rank // size == g) for _ in range(chunks))
        if rank // size == g:
            ep_groups = copies
    for e in range(size):
        group = made([ranks[g * size + e] for g in range(world // size)], rank % size == e)
        if rank % size == e:
            shard_group = group
    return ExpertGroups(size, ep_groups, shard_group, rank % size, tuple(ranks), all_group)


def split_experts(modules: list[nn.Module], groups: ExpertGroups) -> None:
    """Keep this rank's experts of each module and route its calls through the all-to-all."""
    import torch._dynamo           # loaded by then: the runtime's hooks are Dynamo-disabled too (compiled.py)

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
        # Never traced by Dynamo: the routing's sizes are data, read on the host between
        # collectives, and a compiled unit holding the module runs it eagerly between its graphs.
        dispatched = _dispatched(type(module).forward, total, local, groups, f"experts {number}")
        module.forward = types.MethodType(torch._dynamo.disable(dispatched, recursive=True), module)


class _Route(NamedTuple):
    """Where one chunk's all-to-alls go: its copy of the expert-parallel group, this rank's
    place in it, the layer's label in the step log and the runtime's collectives."""

    group: dist.ProcessGroup
    rank: int
    label: str
    watched: _Watched


def _issue(out: torch.Tensor, rows: torch.Tensor, received_sizes: list[int], send_sizes: list[int],
           route: _Route) -> Pending:
    """Rows of `rows` sent in `send_sizes` to each rank of the route's group, `received_sizes`
    from each into `out`, issued without waiting through the runtime's protocol: the step log
    records it with the bytes sent to other ranks. Its order word is the layer's, exchanged
    once before the count exchange (see [Note: ranks that part in a mixture of experts])."""
    collectives = route.watched.collectives
    rows = rows.contiguous()
    nbytes = math.prod(rows.shape[1:]) * rows.element_size() * (sum(send_sizes) - send_sizes[route.rank])
    with issue(collectives.log, collectives.device, ALL_TO_ALL, route.label, nbytes, None, collectives.watch,
               ordered=False) as call:
        call.launch(lambda async_op: dist.all_to_all_single(out, rows, received_sizes, send_sizes, group=route.group,
                                                            async_op=async_op))
        call.keep(rows, out)
    return call.pending


class _Handoff:
    """A backward all-to-all issued by a send-back node and waited for by the all-to-all's own
    node (see [Note: backward behind compute]): the reverse of one forward all-to-all."""

    def __init__(self, route: _Route, send_sizes: list[int], received_sizes: list[int]) -> None:
        self.route, self.send_sizes, self.received_sizes = route, send_sizes, received_sizes
        self.pending: Optional[Pending] = None
        self.received: Optional[torch.Tensor] = None

    def send(self, grad: torch.Tensor) -> None:
        self.received = grad.new_empty((sum(self.received_sizes), *grad.shape[1:]))
        self.pending = _issue(self.received, grad, self.received_sizes, self.send_sizes, self.route)

    def take(self) -> torch.Tensor:
        """The received gradient, once its all-to-all has completed."""
        if self.pending is None:
            raise RuntimeError(f"the backward all-to-all of {self.route.label} was not issued by its send-back node")
        self.pending.wait()
        received, self.pending, self.received = self.received, None, None
        return received


class _AllToAll(torch.autograd.Function):
    """Rows of `rows` sent in `send_sizes` to each rank of the route's group, `received_sizes`
    from each, issued without waiting: its `Pending` is appended to `pending`, and the caller
    waits before reading the result. Backward waits for the gradient that `back`'s send-back
    node sent the reverse way (see [Note: backward behind compute])."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, received_sizes: list[int], send_sizes: list[int], route: _Route,
                pending: list[Pending], back: _Handoff) -> torch.Tensor:
        ctx.back = back
        out = rows.new_empty((sum(received_sizes), *rows.shape[1:]))
        pending.append(_issue(out, rows, received_sizes, send_sizes, route))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        return ctx.back.take(), None, None, None, None, None


def _all_to_all(rows: torch.Tensor, received_sizes: list[int], send_sizes: list[int], route: _Route,
                pending: list[Pending]) -> tuple[torch.Tensor, _Handoff]:
    """`_AllToAll` of `rows`, and the handoff its send-back node issues the reverse through."""
    back = _Handoff(route, received_sizes, send_sizes)
    return _AllToAll.apply(rows, received_sizes, send_sizes, route, pending, back), back


class _SendBack(torch.autograd.Function):
    """`parts` joined (one part: itself, as a view). Backward issues each part's gradient
    through its handoff at once, before the nodes that wait for them run (see [Note: backward
    behind compute]); the gradients passed on are only waited for there."""

    @staticmethod
    def forward(ctx: Any, backs: tuple[_Handoff, ...], *parts: torch.Tensor) -> torch.Tensor:
        ctx.backs, ctx.lengths = backs, [len(part) for part in parts]
        return torch.cat(parts) if len(parts) > 1 else parts[0].view_as(parts[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grads = grad.split(ctx.lengths)
        for back, part in zip(ctx.backs, grads):
            back.send(part)
        return (None, *grads)


def _wait(pending: list[Pending]) -> None:
    """Wait for each issued all-to-all; the order check watches each wait for ranks that
    parted (see [Note: ranks that part in a mixture of experts])."""
    for issued in pending:
        issued.wait()
    pending.clear()


def _dispatched(compute: Callable[..., torch.Tensor], total: int, local: int, groups: ExpertGroups,
                label: str) -> Callable:
    """The expert module's forward over all `total` experts: each token-expert pair goes to the
    rank owning the expert, `compute` (the module's own forward over its `local` experts) runs
    there, and the results come back weighted (see [Note: routing that cannot hang] and [Note:
    dispatch behind compute])."""
    size = groups.size
    routes = tuple(_Route(group, groups.ep_rank, label, groups.watched) for group in groups.ep_groups)

    def forward(self: nn.Module, hidden_ND: torch.Tensor, top_k_index_NK: torch.Tensor,
                top_k_weights_NK: torch.Tensor) -> torch.Tensor:
        N = hidden_ND.shape[0]
        split = splits_backward(self, hidden_ND)
        expert_P = top_k_index_NK.reshape(-1)
        token_P = torch.arange(N, device=hidden_ND.device).repeat_interleave(top_k_index_NK.shape[1])
        weight_P = top_k_weights_NK.reshape(-1)
        kept = expert_P < total                       # an index of `total` or more is a dropped choice
        order = torch.argsort(torch.where(kept, expert_P, total), stable=True)[:int(kept.sum())]
        expert_P, token_P, weight_P = expert_P[order], token_P[order], weight_P[order]
        # Sorted by expert: this rank's own pairs are one run, which stays here, cut in two at
        # the boundary between two of its experts nearest the middle (an expert's pairs split
        # between calls would cost its weight gradient twice).
        mine = torch.arange(groups.ep_rank * local, (groups.ep_rank + 1) * local + 1, dtype=expert_P.dtype,
                            device=expert_P.device)
        starts = torch.searchsorted(expert_P, mine).tolist()
        first, last = starts[0], starts[-1]
        middle = min(starts, key=lambda start: abs(2 * start - first - last))
        own = (slice(first, middle), slice(middle, last))
        sent = torch.cat([torch.arange(first, device=expert_P.device),
                          torch.arange(last, len(expert_P), device=expert_P.device)])
        count = len(routes)
        bounds = [len(sent) * c // count for c in range(count + 1)]
        chunks = [sent[bounds[c]:bounds[c + 1]] for c in range(count)]
        results, rows = [], []                        # the weighted outputs and their tokens

        def compute_own(part: slice) -> None:
            """This rank's own pairs in `part`, computed while an all-to-all is in flight."""
            if part.start == part.stop:
                return
            ones_M1 = torch.ones(part.stop - part.start, 1, dtype=hidden_ND.dtype, device=hidden_ND.device)
            out_MD = expert_call(self, compute, split)(hidden_ND[token_P[part]],
                                                       (expert_P[part] - groups.ep_rank * local)[:, None], ones_M1)
            results.append(out_MD * weight_P[part, None].to(out_MD.dtype))
            rows.append(token_P[part])

        # Pairs per owner rank and its local expert, for each chunk; one exchange carries them
        # all. A chunk's pairs travel sorted by expert, so the counts say which expert each
        # received token is for.
        send = torch.stack([torch.bincount(expert_P[h], minlength=total).view(size, local) for h in chunks], 1)
        send = send.to(torch.int64).cpu().view(size, count * local)
        received = torch.empty_like(send)
        check = groups.watched.check
        if check is not None:
            check.before_issue(ALL_TO_ALL, label, 0)       # the sizes differ between ranks: not in the word
        _wait([_issue(received, send, [1] * size, [1] * size, routes[0])])
        send, received = send.view(size, count, local), received.view(size, count, local)
        sizes = [(received[:, c].sum(1).tolist(), send[:, c].sum(1).tolist()) for c in range(count)]
        local_experts = torch.arange(local, device=hidden_ND.device).repeat(size)
        experts_M = [local_experts.repeat_interleave(received[:, c].reshape(-1).to(hidden_ND.device))
                     for c in range(count)]
        dispatches: list[list[Pending]] = [[] for _ in range(count)]
        tokens = []
        for c, chunk in enumerate(chunks):                     # every chunk's dispatch in flight
            received_sizes, send_sizes = sizes[c]
            tokens.append(_all_to_all(hidden_ND[token_P[chunk]], received_sizes, send_sizes, routes[c], dispatches[c]))
        compute_own(own[0])
        combines: list[Pending] = []
        backs, handoffs = [], []
        for c in range(count):                                 # chunk c + 1 arrives while chunk c computes
            _wait(dispatches[c])
            tokens_MD, sent_back = tokens[c]
            # The weight node before the send-back node: backward runs it after the send (see
            # [Note: expert weight gradients after the send] in overlap/runtime/expert_backward.py).
            call = expert_call(self, compute, split)
            tokens_MD = _SendBack.apply((sent_back,), tokens_MD)    # its gradient goes back from here
            ones_M1 = torch.ones(len(experts_M[c]), 1, dtype=hidden_ND.dtype, device=hidden_ND.device)
            out_MD = call(tokens_MD, experts_M[c][:, None], ones_M1)
            if len(experts_M[c]) == 0 and torch.is_grad_enabled() and not split:
                # No token of this chunk reached this rank's experts, and the call is not split
                # (whose input node keeps the chunk in the graph as it is): zero terms keep it in
                # the dispatch's backward all-to-all and give its experts the (zero) gradient
                # whose reduction the ranks holding the same experts issue.
                # The attributes: the gathered views the unit computes with (the registered
                # parameters are this rank's rows, which no gradient may reach). Each joins the
                # output on its own (see [Note: a backward split in two]).
                out_MD = out_MD + tokens_MD.sum() * 0
                for name in self._parameters:
                    out_MD = out_MD + getattr(self, name).reshape(-1)[:1].sum() * 0
            received_sizes, send_sizes = sizes[c]
            back, handoff = _all_to_all(out_MD, send_sizes, received_sizes, routes[c], combines)
            backs.append(back)
            handoffs.append(handoff)
        compute_own(own[1])
        _wait(combines)
        back_PD = _SendBack.apply(tuple(handoffs), *backs)
        results.append(back_PD * weight_P[sent, None].to(back_PD.dtype))
        rows.append(token_P[sent])
        return torch.zeros_like(hidden_ND).index_add(0, torch.cat(rows), torch.cat(results))

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
    """Why `expert_parallel=size` (and `expert_capacity_factor`) cannot run with the rest of
    the request, or None."""
    capacity = capacity_factor_error("expert_capacity_factor", request.expert_capacity_factor)
    if capacity is not None:
        return capacity
    if size is None:
        # Dropped pairs are left out by the dispatch. Without it they would reach the module
        # itself: Hugging Face's default experts (grouped_mm) mask them only under their own
        # expert parallelism, and otherwise leave their rows uninitialised (NaN within a step).
        return None if request.expert_capacity_factor is None else (
            "expert_capacity_factor needs expert_parallel: the dispatch is what leaves dropped pairs out "
            "(the GPT-MoE of overlap.models.moe takes MoEConfig(capacity_factor=...) without it)")
    if config.sharding == "hpz":
        # A node copy holds a node's ranks' rows of one shard group; an expert unit's shard group
        # is the ranks holding the same experts, which a node does not hold together.
        return ("expert_parallel with sharding='hpz' is not supported: hpZ's node copy gathers a node's ranks' "
                "rows, and an expert unit's rows lie on the ranks holding the same experts; use sharding='full' "
                "or 'hybrid'")
    mesh = request.mesh
    # A 1-D mesh over every rank shards as the world does.
    if mesh is not None and not (mesh.ndim == 1 and (request.stage or mesh.size() == dist.get_world_size())):
        return ("expert_parallel with a mesh other than a pipeline stage's data-parallel one or one over every rank "
                "(tensor parallelism, or hybrid sharding by mesh) is not supported yet: expert parallelism runs over "
                "the world, or over the data-parallel ranks of a pipeline stage (mesh['dp'] of a ('pp', 'dp') mesh)")
    return None
