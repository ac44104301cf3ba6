"""Choosing the expert-parallel size E for ZeRO-3 of a mixture-of-experts transformer: the
(ep, dp) split of a cluster priced per step, as `ShardedModule(model, expert_parallel=E)`
runs it (docs/moe.md).

The accounting:
- Every rank trains its own `batch` sequences (T tokens). Ranks g·E .. g·E + E − 1 form an
  expert-parallel group (consecutive ranks: inside a node while E divides the node's GPUs);
  each holds experts/E of every MoE layer, and the dp = world/E ranks holding the same
  experts shard them by ZeRO-3. Every other parameter is sharded over all ranks.
- Compute, at the cluster's achieved FLOP/s, counts active parameters only (6 FLOPs per
  parameter and token forward + backward, 12·hidden·seq per layer for attention scores, the
  convention of overlap.plan.tensor_parallel): routing is taken as balanced, so each rank's
  experts receive T·top_k (token, choice) pairs whatever E.
- All-to-all: each MoE layer's dispatch and combine send every pair's hidden vector in bf16,
  (E − 1)/E of it off the rank; of the E − 1 peers, E − gpus_per_node sit on other nodes once
  E spans nodes, and their share goes through the rank's NIC while the rest rides NVLink
  (the slower of the two bounds the call). Forward runs two (dispatch, combine), backward two.
- Dual-batch overlap (overlap/runtime/expert_parallel.py): the 1/E of a rank's pairs whose
  expert it holds stay and are computed in two parts; the pairs sent are split in halves,
  both sent before any received token is computed. With a the time of one half's all-to-all,
  c one half's expert compute and o one own part's in that pass, a pass exposes
  4a − 2·min(a, c) − 2·min(a, o): the middle two all-to-alls as far as the halves' compute
  outlasts them, the first and the last as far as an own part does (the count exchange is
  not priced). Backward runs the same in reverse (both combines' gradients sent during the
  second own part's backward, then each half's expert backward while the other half's
  all-to-all travels, the last tokens' gradients during the first own part's), with c and o
  twice forward's.
- ZeRO-3: per layer, the dense part gathered (bf16) and reduce-scattered (fp32) over the
  world's ring and the rank's experts over its dp ring (overlap.plan.tensor_parallel.dp_link:
  a ring of every E-th rank), one after the other on the collective stream, with prefetch
  depth 1: the next layer's gather runs under this layer's forward, the previous layer's
  reduction and the next one's gather under this layer's backward. The embeddings and head
  are gathered before the first layer and reduced after the last.
- Memory per rank: model states (16 bytes per parameter) of 1/world of the dense parameters
  and (1/E)/(world/E) of the experts, which is 1/world of them too; the embeddings and two
  layers gathered in bf16 (the one computing and the one prefetched), one layer's fp32
  unsharded gradient; activations (below).
- Activations: overlap.plan.memory's layer formula with its 4h MLP replaced by what an MoE
  MLP keeps: per pair the dispatched input and the expert's output (2·hidden) and its SwiGLU
  tensors (3·expert_ffn), 3·expert_ffn per token for each shared expert, the router's fp32
  probabilities; the dense layers' SwiGLU keeps 3·dense_ffn per token. With activation
  checkpointing each layer's input is kept, one layer is recomputed at a time, and the
  recomputed forward runs its all-to-alls again.

[Note: why not the replay]
overlap.plan.cost_model replays one step with every unit's collectives on one group; here a
layer's dense part and its experts gather over different groups (the world and every E-th
rank), so the step is priced per layer in closed form: exact where every layer costs the same,
which all but the dense first layers do.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from overlap.plan.links import LinkModel
from overlap.plan.memory import ActivationShape, activation_bytes, layer_activation_bytes
from overlap.plan.tensor_parallel import (GATHER_BYTES, REDUCE_BYTES, STATE_BYTES, ClusterShape, dp_link,
                                          recomputed_flops)

SWIGLU_MATRICES = 3                 # gate, up and down projections of every MLP
ROUTER_PROB_BYTES = 4               # fp32 routing probabilities kept per token and expert
# What overlap.plan.memory's layer formula counts for its 4h MLP beyond the MLP's input, in
# units of seq·batch·hidden: the GELU input (4) and the second matmul's input (4).
FOUR_H_MLP_ELEMENTS = 8


@dataclass(frozen=True)
class MoEShape:
    """A decoder whose first `dense_layers` layers have a SwiGLU MLP of width `dense_ffn` and
    whose others route each token to `top_k` of `experts` SwiGLU experts of width
    `expert_ffn`, beside `shared_experts` that see every token. `attention_params` is one
    layer's attention with its norms; embeddings and head are untied."""

    layers: int
    dense_layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    attention_params: int
    dense_ffn: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "attention_params", "experts", "top_k",
                     "expert_ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{name}={value!r} is invalid; expected an integer >= 1")
        if not 0 <= self.dense_layers < self.layers:
            raise ValueError(f"MoEShape.dense_layers={self.dense_layers} is invalid; expected 0 to layers - 1 "
                             f"({self.layers - 1}): at least one layer has experts")
        if self.dense_layers and self.dense_ffn < 1:
            raise ValueError(f"MoEShape.dense_ffn={self.dense_ffn} is invalid with {self.dense_layers} dense layers")
        if self.top_k > self.experts:
            raise ValueError(f"MoEShape.top_k={self.top_k} is more than its {self.experts} experts")
        if self.shared_experts < 0:
            raise ValueError(f"MoEShape.shared_experts={self.shared_experts} is invalid; expected >= 0")

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def expert_params(self) -> int:
        """One expert's parameters."""
        return SWIGLU_MATRICES * self.hidden * self.expert_ffn

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + SWIGLU_MATRICES * self.hidden * self.dense_ffn

    @property
    def moe_dense_params(self) -> int:
        """An MoE layer's parameters outside its routed experts: attention, router, shared experts."""
        return self.attention_params + self.experts * self.hidden + self.shared_experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden          # input and output embeddings, final norm

    @property
    def dense_params(self) -> int:
        """Parameters sharded over every rank."""
        return (self.dense_layers * self.dense_layer_params + self.moe_layers * self.moe_dense_params
                + self.embedding_params)

    @property
    def routed_params(self) -> int:
        """Parameters of every routed expert, sharded over the ranks holding the same experts."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def params(self) -> int:
        return self.dense_params + self.routed_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params

    @property
    def flops_per_token(self) -> float:
        """Forward + backward, by the convention above (the input embedding's lookup is free)."""
        matmuls = self.active_params - self.vocab * self.hidden - self.hidden
        return 6 * matmuls + 12 * self.layers * self.hidden * self.seq


@dataclass(frozen=True)
class LayerCost:
    """One layer of one rank's step: compute and exposed all-to-all per pass, ZeRO-3's
    collectives, parameters gathered."""

    forward_s: float             # compute plus the all-to-all it leaves exposed
    backward_s: float            # likewise (with checkpointing: the recomputed forward too)
    gather_s: float              # dense part over the world, then the rank's experts over dp
    reduce_s: float
    gathered_params: int         # this rank's view of the layer, gathered
    a2a_s: float                 # all-to-all time of the layer in one step
    a2a_hidden_s: float          # of which under expert compute


@dataclass(frozen=True)
class EpOption:
    ep: int
    dp: int                      # ranks holding the same experts: world / ep
    step_s: float
    tokens_per_s: float          # per GPU
    compute_s: float             # the model's FLOPs at the cluster's rate (no recomputation)
    a2a_s: float                 # all-to-all time in one step
    a2a_exposed_s: float
    a2a_hidden_s: float
    zero_exposed_s: float        # ZeRO-3's gathers and reductions not hidden by compute
    memory_bytes: float          # per rank
    a2a_bytes_per_layer: float   # bytes one rank sends in one MoE layer's four all-to-alls
    a2a_network_share: float     # share of those bytes that leave the node


def ep_sizes(model: MoEShape, cluster: ClusterShape) -> list[int]:
    """Powers of two that divide the world and the experts."""
    sizes, ep = [], 1
    while ep <= cluster.ranks:
        if cluster.ranks % ep == 0 and model.experts % ep == 0:
            sizes.append(ep)
        ep *= 2
    return sizes


def a2a_bytes(model: MoEShape, tokens: int, ep: int) -> float:
    """Bytes one rank sends in one all-to-all of `tokens` tokens' pairs (a dispatch or a
    combine): every pair's bf16 hidden vector bound for the E − 1 other ranks."""
    return tokens * model.top_k * model.hidden * GATHER_BYTES * (ep - 1) / ep


def network_share(ep: int, gpus_per_node: int) -> float:
    """Share of an all-to-all's off-rank bytes that leave the node: E − gpus_per_node of the
    E − 1 peers are on other nodes once the group spans nodes."""
    return 0.0 if ep <= gpus_per_node else (ep - gpus_per_node) / (ep - 1)


def a2a_s(nbytes: float, ep: int, cluster: ClusterShape) -> float:
    """An all-to-all where each rank sends `nbytes` to its peers: the network's share through
    the rank's NIC beside NVLink's share, the slower bounding it."""
    if ep == 1:
        return 0.0
    share = network_share(ep, cluster.gpus_per_node)
    alpha = cluster.base_alpha + (cluster.network_alpha_step if share else cluster.node_link.alpha)
    return alpha + max(nbytes * share / cluster.network_beta, nbytes * (1 - share) / cluster.node_link.beta)


def two_chunk_exposed(half_a2a_s: float, half_compute_s: float, own_part_s: float) -> float:
    """The exposed all-to-all of one pass split in two halves (send both, compute the first
    while the second travels, send the first back while the second computes), the first
    dispatch and the last combine behind an own part each: 4a − 2·min(a, c) − 2·min(a, o)."""
    return 4 * half_a2a_s - 2 * min(half_a2a_s, half_compute_s) - 2 * min(half_a2a_s, own_part_s)


def _ring_s(link: LinkModel, ranks: int, nbytes: float) -> float:
    """A ring all-gather or reduce-scatter of an `nbytes` buffer over `ranks` ranks."""
    return link.time(nbytes * (ranks - 1) / ranks) if ranks > 1 and nbytes > 0 else 0.0


def _moe_layer(model: MoEShape, cluster: ClusterShape, tokens: int, ep: int, checkpointing: bool) -> LayerCost:
    dense_flops = tokens * (6 * model.moe_dense_params + 12 * model.hidden * model.seq)
    expert_flops = tokens * 6 * model.top_k * model.expert_params
    dense_s, expert_s = dense_flops / cluster.flops, expert_flops / cluster.flops
    half = a2a_s(a2a_bytes(model, tokens, ep) / 2, ep, cluster)
    sent_half, own_part = expert_s / 3 * (ep - 1) / ep / 2, expert_s / 3 / ep / 2    # forward's
    forward_exposed = two_chunk_exposed(half, sent_half, own_part)
    backward_exposed = two_chunk_exposed(half, 2 * sent_half, 2 * own_part)
    forward_s = (dense_s + expert_s) / 3 + forward_exposed
    backward_s = 2 * (dense_s + expert_s) / 3 + backward_exposed
    passes = 2 if checkpointing else 1                 # forward's all-to-alls run again in the recompute
    if checkpointing:
        backward_s += forward_s
    dp = cluster.ranks // ep
    local_experts = model.experts // ep * model.expert_params
    world_link, dp_ring = dp_link(1, cluster), dp_link(ep, cluster)
    gather = (_ring_s(world_link, cluster.ranks, model.moe_dense_params * GATHER_BYTES)
              + _ring_s(dp_ring, dp, local_experts * GATHER_BYTES))
    reduce = (_ring_s(world_link, cluster.ranks, model.moe_dense_params * REDUCE_BYTES)
              + _ring_s(dp_ring, dp, local_experts * REDUCE_BYTES))
    a2a_total = (passes + 1) * 4 * half
    hidden = passes * (4 * half - forward_exposed) + 4 * half - backward_exposed
    return LayerCost(forward_s, backward_s, gather, reduce, model.moe_dense_params + local_experts, a2a_total, hidden)


def _dense_layer(model: MoEShape, cluster: ClusterShape, tokens: int, checkpointing: bool) -> LayerCost:
    compute_s = tokens * (6 * model.dense_layer_params + 12 * model.hidden * model.seq) / cluster.flops
    link = dp_link(1, cluster)
    # Backward is two thirds of the layer's compute, plus the recomputed forward's third.
    return LayerCost(compute_s / 3, recomputed_flops(compute_s, checkpointing) - compute_s / 3,
                     _ring_s(link, cluster.ranks, model.dense_layer_params * GATHER_BYTES),
                     _ring_s(link, cluster.ranks, model.dense_layer_params * REDUCE_BYTES),
                     model.dense_layer_params, 0.0, 0.0)


def layer_costs(model: MoEShape, cluster: ClusterShape, batch: int, ep: int,
                checkpointing: bool = False) -> list[LayerCost]:
    """Every layer of one rank's step, in forward order."""
    tokens = batch * model.seq
    dense = _dense_layer(model, cluster, tokens, checkpointing)
    moe = _moe_layer(model, cluster, tokens, ep, checkpointing)
    return [dense] * model.dense_layers + [moe] * model.moe_layers


def zero3_step_s(layers: Sequence[LayerCost], root_gather_s: float, root_reduce_s: float, head_s: float) -> float:
    """The step with prefetch depth 1 (see the module docstring): forward waits for the root's
    and the first layer's gathers, then each layer takes the longer of its forward and the next
    gather; backward each layer the longer of its backward and the previous layer's gather
    plus the next one's reduction; the last reductions end the step."""
    count = len(layers)
    forward = root_gather_s + layers[0].gather_s + sum(
        max(layer.forward_s, layers[i + 1].gather_s if i + 1 < count else 0.0) for i, layer in enumerate(layers))
    backward = sum(max(layers[i].backward_s, (layers[i - 1].gather_s if i > 0 else 0.0)
                       + (layers[i + 1].reduce_s if i + 1 < count else 0.0)) for i in range(count))
    return forward + head_s + backward + layers[0].reduce_s + root_reduce_s


def moe_activation_bytes(model: MoEShape, batch: int, checkpointing: bool) -> float:
    """Activations of one rank's step at their peak (see the module docstring)."""
    tokens = batch * model.seq
    one = ActivationShape(batch, model.seq, model.hidden, 1, model.heads)
    base = layer_activation_bytes(one, GATHER_BYTES) - FOUR_H_MLP_ELEMENTS * GATHER_BYTES * tokens * model.hidden
    moe_mlp = (GATHER_BYTES * tokens * (model.top_k * (2 * model.hidden + SWIGLU_MATRICES * model.expert_ffn)
                                        + model.shared_experts * SWIGLU_MATRICES * model.expert_ffn)
               + ROUTER_PROB_BYTES * tokens * model.experts)
    dense_mlp = GATHER_BYTES * tokens * SWIGLU_MATRICES * model.dense_ffn
    moe_layer, dense_layer = base + moe_mlp, base + dense_mlp
    head = activation_bytes(replace(one, vocab=model.vocab), GATHER_BYTES, False) - activation_bytes(
        one, GATHER_BYTES, False)
    if checkpointing:
        largest = max(moe_layer, dense_layer) if model.dense_layers else moe_layer
        return model.layers * GATHER_BYTES * tokens * model.hidden + largest + head
    return model.moe_layers * moe_layer + model.dense_layers * dense_layer + head


def evaluate_ep(model: MoEShape, cluster: ClusterShape, batch: int, ep: int, checkpointing: bool = False) -> EpOption:
    if ep < 1 or cluster.ranks % ep or model.experts % ep:
        raise ValueError(f"expert-parallel size {ep} must divide the {cluster.ranks} ranks and the "
                         f"{model.experts} experts")
    tokens = batch * model.seq
    layers = layer_costs(model, cluster, batch, ep, checkpointing)
    world_link = dp_link(1, cluster)
    root_gather = _ring_s(world_link, cluster.ranks, model.embedding_params * GATHER_BYTES)
    root_reduce = _ring_s(world_link, cluster.ranks, model.embedding_params * REDUCE_BYTES)
    head_s = tokens * 6 * model.vocab * model.hidden / cluster.flops
    step = zero3_step_s(layers, root_gather, root_reduce, head_s)
    compute = tokens * model.flops_per_token / cluster.flops
    a2a = sum(layer.a2a_s for layer in layers)
    hidden = sum(layer.a2a_hidden_s for layer in layers)
    # Compute as it runs (recomputation's forward counted once per pass) plus the exposed all-to-all.
    lanes = head_s + sum(layer.forward_s + layer.backward_s for layer in layers)
    largest = max(layer.gathered_params for layer in layers)
    states = STATE_BYTES * (model.dense_params / cluster.ranks + model.routed_params / ep / (cluster.ranks // ep))
    memory = (states + GATHER_BYTES * (model.embedding_params + 2 * largest) + REDUCE_BYTES * largest
              + moe_activation_bytes(model, batch, checkpointing))
    return EpOption(ep, cluster.ranks // ep, step, tokens / step, compute, a2a, a2a - hidden, hidden, step - lanes,
                    memory, 4 * a2a_bytes(model, tokens, ep), network_share(ep, cluster.gpus_per_node))


def ep_options(model: MoEShape, cluster: ClusterShape, batch: int, checkpointing: bool = False) -> list[EpOption]:
    return [evaluate_ep(model, cluster, batch, ep, checkpointing) for ep in ep_sizes(model, cluster)]


def choose_ep(options: Sequence[EpOption], memory_bytes: float) -> Optional[EpOption]:
    """The fastest option that fits in `memory_bytes` per rank (None: none fits)."""
    fitting = [option for option in options if option.memory_bytes <= memory_bytes]
    return min(fitting, key=lambda option: option.step_s) if fitting else None


def nodes_to_fit(model: MoEShape, cluster: ClusterShape, batch: int, checkpointing: bool,
                 max_nodes: int = 1024) -> Optional[int]:
    """The fewest nodes (the cluster's count doubled) at which some expert-parallel size fits a
    GPU's memory; None up to `max_nodes`."""
    nodes = cluster.nodes
    while nodes <= max_nodes:
        larger = replace(cluster, nodes=nodes)
        if choose_ep(ep_options(model, larger, batch, checkpointing), larger.memory_bytes) is not None:
            return nodes
        nodes *= 2
    return None
