"""Choosing (dp, tp) for ZeRO-3 over dp of a transformer split by tensor parallelism over tp.

The accounting (Megatron's, as torchtitan's 2-D recipe runs it):
- TP splits every layer's matrices over the tp ranks of one node (tp divides the GPUs of a
  node and the attention and KV heads), the embeddings and head too (torchtitan's plan), and,
  with sequence parallelism, the activations: a rank holds 1/tp of its group's.
- The global batch is fixed (`global_batch` sequences): each of the dp = ranks / tp groups
  computes global_batch / dp sequences (a whole number, at least one), its ranks 1/tp of the
  FLOPs each. So compute per GPU is the same at every tp; what tp changes is communication
  and memory.
- TP's collectives: per layer, two all-reduces of the group's activations in forward and two
  in backward (reduce-scatter + all-gather with sequence parallelism: the same bytes), on the
  node's NVLink, on the critical path (each waits for the matmul before it): added to the
  layer's compute.
- ZeRO-3 over dp: each rank's 1/tp of a layer gathered and reduce-scattered over dp ranks, by
  the planner's own replay (`overlap.plan.cost_model`), on the dp ring: one rank per node over
  the network when tp fills the node, else a ring that crosses the network too and is bounded
  by it. Model states: 16 bytes per parameter (AdamW, fp32 masters) over dp * tp ranks.

The pick is the fastest option that fits the memory; larger tp shrinks the gathers and the
states per rank and lets the global batch spread over more GPUs, at the price of the per-layer
all-reduces, which grow with the tokens per group.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from overlap.plan.cost_model import Prediction, Profile, UnitCost, predict_step
from overlap.plan.links import LinkModel
from overlap.plan.memory import MASTER_BYTES, ActivationShape, MemoryEstimate, activation_bytes, state_copies

GATHER_BYTES = 2       # bf16 parameters and activations
REDUCE_BYTES = 4       # fp32 gradient reduction
STATE_BYTES = state_copies("adamw") * MASTER_BYTES
TP_ALL_REDUCES_PER_LAYER = 4       # two in forward, two in backward
# Full activation checkpointing: backward runs the layer's forward (a third of its compute,
# backward being twice forward) again before its own work.
RECOMPUTE_FACTOR = 4 / 3


def recomputed_flops(flops: float, checkpointing: bool) -> float:
    """A layer's forward-and-backward FLOPs, with the forward run again in backward under full
    activation checkpointing."""
    return flops * RECOMPUTE_FACTOR if checkpointing else flops


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    layer_params: int
    embedding_params: int

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    flops: float                 # achieved FLOP/s per GPU (peak x MFU)
    memory_bytes: float
    node_link: LinkModel         # NVLink: alpha of one ring step inside a node, bus bandwidth
    network_alpha_step: float    # latency of one ring step across nodes
    network_beta: float          # bus bandwidth of a ring that crosses the network
    base_alpha: float = 8e-6

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class TpOption:
    tp: int
    dp: int
    sequences_per_group: int
    tp_comm_s: float             # TP's all-reduces in one step
    prediction: Prediction       # the step with ZeRO-3's gathers over dp
    memory_bytes: float          # per rank: states, gathered buffers in flight, activations

    @property
    def step_s(self) -> float:
        return self.prediction.step_s


def tp_degrees(model: TransformerShape, cluster: ClusterShape, global_batch: int) -> list[int]:
    """Powers of two that divide a node's GPUs and the heads, with a whole batch per dp group."""
    degrees = []
    tp = 1
    while tp <= cluster.gpus_per_node:
        dp = cluster.ranks // tp
        if cluster.gpus_per_node % tp == 0 and model.heads % tp == 0 and model.kv_heads % tp == 0 \
                and global_batch % dp == 0:
            degrees.append(tp)
        tp *= 2
    return degrees


def tp_all_reduce_s(nbytes: float, tp: int, cluster: ClusterShape) -> float:
    """A ring all-reduce of `nbytes` over `tp` ranks of one node."""
    if tp == 1:
        return 0.0
    alpha = cluster.base_alpha + 2 * (tp - 1) * cluster.node_link.alpha
    return alpha + 2 * (tp - 1) / tp * nbytes / cluster.node_link.beta


def dp_link(tp: int, cluster: ClusterShape) -> LinkModel:
    """The ring over the dp ranks of one tp position: `nodes` ranks, one per node, when tp
    fills the node; otherwise gpus_per_node / tp ranks per node, crossing the network too."""
    dp = cluster.ranks // tp
    per_node = dp // cluster.nodes if dp >= cluster.nodes else 1
    network_steps = cluster.nodes - 1 if dp >= cluster.nodes else dp - 1
    alpha = cluster.base_alpha + (dp - 1 - network_steps) * cluster.node_link.alpha + network_steps * cluster.network_alpha_step
    beta = cluster.network_beta if cluster.nodes > 1 and dp > 1 else cluster.node_link.beta
    kind = "network" if cluster.nodes > 1 and dp > per_node else "nvlink"
    return LinkModel(kind, alpha, beta, "preset")


def evaluate_tp(model: TransformerShape, cluster: ClusterShape, global_batch: int, tp: int, depth: int,
                checkpointing: bool) -> TpOption:
    dp = cluster.ranks // tp
    sequences = global_batch // dp
    tokens = sequences * model.seq
    layer_flops = tokens * (6 * model.layer_params + 12 * model.hidden * model.seq) / tp
    head_flops = tokens * 6 * model.vocab * model.hidden / tp
    per_all_reduce = tp_all_reduce_s(tokens * model.hidden * GATHER_BYTES, tp, cluster)
    tp_per_layer = TP_ALL_REDUCES_PER_LAYER * per_all_reduce
    layer_params = model.layer_params / tp

    def unit(name: str, params: float, flops: float, tp_s: float) -> UnitCost:
        forward_flops = flops / 3
        backward_flops = recomputed_flops(flops, checkpointing) - forward_flops
        return UnitCost(name, int(params * MASTER_BYTES), int(params * GATHER_BYTES), int(params * REDUCE_BYTES),
                        forward_flops / cluster.flops + tp_s / 2, backward_flops / cluster.flops + tp_s / 2)

    units = tuple(unit(f"layers.{i}", layer_params, layer_flops, tp_per_layer) for i in range(model.layers))
    root = unit("root", model.embedding_params / tp, 0.0, 0.0)
    profile = Profile(units, dp, root, head_flops / cluster.flops)
    prediction = predict_step(profile, dp_link(tp, cluster), depth, depth)
    shape = ActivationShape(sequences, model.seq, model.hidden, model.layers, model.heads, model.vocab)
    memory = (STATE_BYTES * model.params / cluster.ranks + prediction.peak_gathered_bytes
              + max(u.reduce_bytes for u in units) + activation_bytes(shape, GATHER_BYTES, checkpointing) / tp)
    return TpOption(tp, dp, sequences, model.layers * tp_per_layer, prediction, memory)


def tp_options(model: TransformerShape, cluster: ClusterShape, global_batch: int, depth: int = 1,
               checkpointing: bool = False) -> list[TpOption]:
    return [evaluate_tp(model, cluster, global_batch, tp, depth, checkpointing)
            for tp in tp_degrees(model, cluster, global_batch)]


def choose_tp(options: Sequence[TpOption], memory_bytes: float) -> Optional[TpOption]:
    """The fastest option that fits in `memory_bytes` per rank (None: none fits)."""
    fitting = [option for option in options if option.memory_bytes <= memory_bytes]
    return min(fitting, key=lambda option: option.step_s) if fitting else None


def tensor_parallel_share(result: MemoryEstimate, tp: int) -> MemoryEstimate:
    """`result`, estimated for 1/tp of the parameters over the dp ranks, with 1/tp of the
    activations: what one rank of a tp group holds when every parameter is split and the
    activations are split by sequence parallelism."""
    activations = None if result.activations is None else result.activations / tp
    return replace(result, activations=activations)
