"""Choosing (dp, tp, pp, microbatches, schedule) for ZeRO-3 over dp, tensor parallelism over
tp and pipeline stages over pp, at one global batch.

The accounting, beyond overlap.plan.tensor_parallel's (whose TP cost, recompute under
activation checkpointing and dp ring it reuses):
- Ranks are ordered tp innermost, then dp, then pp (Megatron's order with pp outermost): a
  stage is tp * dp consecutive ranks, so stages sit on different nodes once tp * dp fills a
  node, and the activations between stages cross the network.
- Each stage holds ceil(layers / pp) layers (the last stage the head too); a step runs
  m = sequences per dp group / microbatch size microbatches through it. A slot is one
  microbatch's forward and backward on the slowest stage (the last, with the head), plus its
  sends to the neighbours, which torch's schedules wait for: 2 sends (activation forward,
  gradient back) of microbatch * seq * hidden / tp bf16 elements each (sequence parallelism).
- 1F1B and GPipe take (m + pp - 1) slots (the same bubble; GPipe holds every microbatch's
  activations). Interleaved1F1B with v stages per rank takes (m * v + pp - 1) slots of a
  v-th of the work each: the bubble shrinks v times, the sends grow v times.
- ZeRO-3 inside a stage, the planner's choice of overlap.plan.microbatch_keep: units kept
  gathered across the microbatches when the memory allows (one gather and one reduction per
  unit and step), else gathered again for every microbatch. Kept, the gathers run under the
  first stage's first forward and the reductions under its last backward; only what exceeds
  them, plus one unit's gather and one unit's reduction, is exposed. Regathered, each
  microbatch's forward and backward hide the gathers as far as they last.
- Memory per rank: model states (16 bytes per parameter) of the stage over tp * dp; the
  stage's gathered bf16 parameters and its fp32 unsharded gradients when kept (two units of
  each otherwise); the layers' activations of the microbatches in flight on the first stage
  (pp of them under 1F1B, m under GPipe, pp * (1 + (pp - 1) / (pp * v)) interleaved) and the
  head's of one microbatch, split by tp.
Left out: context parallelism, uneven stage cuts, the optimizer step, p2p overlapped with
compute (Megatron's overlap_p2p_comm), and the zero-bubble schedules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from overlap.plan.links import LinkModel
from overlap.plan.memory import ActivationShape, activation_bytes
from overlap.plan.tensor_parallel import (GATHER_BYTES, REDUCE_BYTES, STATE_BYTES, TP_ALL_REDUCES_PER_LAYER,
                                          ClusterShape, TransformerShape, dp_link, recomputed_flops, tp_all_reduce_s)

INTERLEAVED_STAGES = (2, 4, 5)     # stages per rank tried for Interleaved1F1B


@dataclass(frozen=True)
class PipelineLayout:
    """One way to run the global batch: the split of the ranks and the schedule."""

    dp: int
    tp: int
    pp: int
    microbatch: int              # sequences per microbatch
    schedule: str                # "1F1B", "GPipe", "Interleaved1F1B"; "none" at pp 1
    virtual: int = 1             # stages per rank (Interleaved1F1B)


@dataclass(frozen=True)
class PipelineOption:
    layout: PipelineLayout
    microbatches: int
    kept: bool                   # units kept gathered across the step's microbatches
    step_s: float
    bubble: float                # share of the step's slots that are fill and drain
    tp_comm_s: float             # TP's all-reduces on the critical path in one step
    p2p_s: float                 # sends between stages on the critical path in one step
    zero_exposed_s: float        # ZeRO-3's gathers and reductions not hidden by compute
    memory_bytes: float          # per rank, on the first stage


def _stage_cluster(cluster: ClusterShape, ranks: int) -> ClusterShape:
    """The ranks of one stage as a cluster of their own: whole nodes, or part of one."""
    if ranks >= cluster.gpus_per_node:
        return replace(cluster, nodes=ranks // cluster.gpus_per_node)
    return replace(cluster, nodes=1, gpus_per_node=ranks)


def p2p_link(layout: PipelineLayout, cluster: ClusterShape) -> LinkModel:
    """A send between neighbouring stages: over the network once a stage fills a node (one
    NIC per GPU), else over NVLink."""
    if layout.tp * layout.dp >= cluster.gpus_per_node and cluster.nodes > 1:
        return LinkModel("network", cluster.base_alpha + cluster.network_alpha_step, cluster.network_beta, "preset")
    return LinkModel("nvlink", cluster.base_alpha + cluster.node_link.alpha, cluster.node_link.beta, "preset")


def evaluate_pipeline(model: TransformerShape, cluster: ClusterShape, global_batch: int, layout: PipelineLayout,
                      checkpointing: bool = False) -> PipelineOption:
    dp, tp, pp, v = layout.dp, layout.tp, layout.pp, layout.virtual
    m = global_batch // dp // layout.microbatch
    layers = math.ceil(model.layers / pp)
    tokens = layout.microbatch * model.seq
    # One microbatch through one layer, forward + backward (backward twice forward), on one GPU.
    layer_flops = tokens * (6 * model.layer_params + 12 * model.hidden * model.seq) / tp
    layer_s = recomputed_flops(layer_flops, checkpointing) / cluster.flops
    layer_s += TP_ALL_REDUCES_PER_LAYER * tp_all_reduce_s(tokens * model.hidden * GATHER_BYTES, tp, cluster)
    head_s = tokens * 6 * model.vocab * model.hidden / tp / cluster.flops
    stage_s = layers * layer_s + head_s          # the last stage, the slowest
    send_s = p2p_link(layout, cluster).time(tokens * model.hidden * GATHER_BYTES / tp) if pp > 1 else 0.0
    slots = m * v + pp - 1
    slot_s = stage_s / v + 2 * send_s
    pipeline_s = slots * slot_s

    # ZeRO-3 over the stage's dp ranks (the first stage: the step's first forward and last backward).
    stage_params = (layers * model.layer_params + model.embedding_params / (2 if pp > 1 else 1)) / tp
    unit_params = model.layer_params / tp
    link = dp_link(tp, _stage_cluster(cluster, tp * dp))
    share = (dp - 1) / dp

    def gather(params: float) -> float:
        return link.time(params * GATHER_BYTES * share) if dp > 1 else 0.0

    def reduce(params: float) -> float:
        return link.time(params * REDUCE_BYTES * share) if dp > 1 else 0.0

    forward_s, backward_s = layers * layer_s / 3, 2 * layers * layer_s / 3
    kept_exposed = (gather(unit_params) + max(0.0, gather(stage_params) - forward_s)
                    + reduce(unit_params) + max(0.0, reduce(stage_params) - backward_s))
    regather_exposed = (gather(unit_params) + m * (max(0.0, gather(stage_params) - forward_s)
                                                   + max(0.0, gather(stage_params) - backward_s))
                        + reduce(unit_params) + max(0.0, reduce(stage_params) - backward_s))

    in_flight = {"GPipe": m, "1F1B": min(m, pp)}.get(layout.schedule, pp * (1 + (pp - 1) / (pp * v)))
    stage = ActivationShape(layout.microbatch, model.seq, model.hidden, layers, model.heads)
    with_head = replace(stage, vocab=model.vocab)
    head = activation_bytes(with_head, GATHER_BYTES, checkpointing) - activation_bytes(stage, GATHER_BYTES, checkpointing)
    # The layers' activations of every microbatch in flight; the head's (logits and loss) of one.
    activations = (in_flight * activation_bytes(stage, GATHER_BYTES, checkpointing) + head) / tp
    states = STATE_BYTES * stage_params / dp
    kept_bytes = stage_params * (GATHER_BYTES + REDUCE_BYTES)
    two_units = 2 * unit_params * (GATHER_BYTES + REDUCE_BYTES)
    kept = states + kept_bytes + activations <= cluster.memory_bytes
    memory = states + activations + (kept_bytes if kept else two_units)
    exposed = kept_exposed if kept else regather_exposed
    tp_comm = slots / v * layers * TP_ALL_REDUCES_PER_LAYER * tp_all_reduce_s(tokens * model.hidden * GATHER_BYTES,
                                                                              tp, cluster)
    return PipelineOption(layout, m, kept, pipeline_s + exposed, (pp - 1) / slots, tp_comm, slots * 2 * send_s,
                          exposed, memory)


def pipeline_layouts(model: TransformerShape, cluster: ClusterShape, global_batch: int,
                     microbatch: int = 1) -> list[PipelineLayout]:
    """Every layout the schedules accept: tp a power of two dividing a node's GPUs and the
    heads, pp a power of two up to the layers, dp the rest with a whole number of microbatches
    per dp group and at least pp of them; Interleaved1F1B with a multiple of pp microbatches
    and at least one layer per virtual stage."""
    layouts = []
    tp = 1
    while tp <= cluster.gpus_per_node:
        if cluster.gpus_per_node % tp == 0 and model.heads % tp == 0 and model.kv_heads % tp == 0:
            pp = 1
            while tp * pp <= cluster.ranks and pp <= model.layers:
                dp = cluster.ranks // (tp * pp)
                if cluster.ranks % (tp * pp) == 0 and global_batch % (dp * microbatch) == 0:
                    m = global_batch // dp // microbatch
                    if pp == 1:
                        layouts.append(PipelineLayout(dp, tp, 1, microbatch, "none"))   # accumulation only
                    elif m >= pp:
                        layouts += [PipelineLayout(dp, tp, pp, microbatch, s) for s in ("1F1B", "GPipe")]
                        layouts += [PipelineLayout(dp, tp, pp, microbatch, "Interleaved1F1B", v)
                                    for v in INTERLEAVED_STAGES if m % pp == 0 and model.layers >= pp * v]
                pp *= 2
        tp *= 2
    return layouts


def pipeline_options(model: TransformerShape, cluster: ClusterShape, global_batch: int, microbatch: int = 1,
                     checkpointing: bool = False) -> list[PipelineOption]:
    return [evaluate_pipeline(model, cluster, global_batch, layout, checkpointing)
            for layout in pipeline_layouts(model, cluster, global_batch, microbatch)]


def choose_pipeline(options: Sequence[PipelineOption], memory_bytes: float) -> Optional[PipelineOption]:
    """The fastest option that fits in `memory_bytes` per rank (None: none fits)."""
    fitting = [option for option in options if option.memory_bytes <= memory_bytes]
    return min(fitting, key=lambda option: option.step_s) if fitting else None
