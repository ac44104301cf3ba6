"""`overlap simulate`: the predicted step of a model on a cluster, from the planner's cost model.

Compute per unit comes from FLOPs at a stated MFU, communication from the cluster's α-β
model; the replay, the bucket rule and the depth choice are the planner's own
(`overlap.plan.prefetch`), so the pick printed here is the one the runtime would make given the
same timings. Assumptions (see docs/planner.md): one unit per transformer layer; bf16
gathers and fp32 gradient reduction (the usual FSDP policy); fp32 master weights, gradients
and two Adam moments sharded over all ranks (16 bytes per parameter / N); activations by
`overlap estimate`'s formula (`overlap.plan.memory`) in bf16 with fused attention; the
optimizer step and data loading are not in the step time. With --offload cpu|disk, the bytes
per rank in each tier and the step with offload's copies, CPU update and disk IO added
(`overlap.plan.offload`, rates as in `overlap estimate`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from overlap.cli.estimate import add_offload_arguments, offload_lines, offload_rates
from overlap.plan.budget import gathered_budget
from overlap.plan.cost_model import Prediction, Profile, UnitCost, predict_step
from overlap.plan.memory import MASTER_BYTES, ActivationShape, activation_bytes, state_copies
from overlap.plan.prefetch import MAX_DEPTH, choose_bucket_bytes, choose_depths, merge_costs
from overlap.plan.sharding import Levels, choose_sharding
from overlap.plan.links import LinkModel
from overlap.cli.published import PUBLISHED, PUBLISHED_MOE
from overlap.plan.expert_parallel import EpOption, MoEShape, choose_ep, ep_options, nodes_to_fit
from overlap.plan.offload import offload_time
from overlap.plan.pipeline import PipelineLayout, PipelineOption, choose_pipeline, evaluate_pipeline, pipeline_options
from overlap.plan.tensor_parallel import ClusterShape, TransformerShape, choose_tp, tp_options

GATHER_BYTES = 2       # bf16 parameters
REDUCE_BYTES = 4       # fp32 gradient reduction
# fp32 master + fp32 gradient + Adam's two moments, per parameter (bucket sizes count the master)
STATE_BYTES = state_copies("adamw") * MASTER_BYTES
TIMELINE_WIDTH = 72


@dataclass(frozen=True)
class ModelPreset:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    gated_mlp: bool        # SwiGLU: three matrices instead of two
    tied_embeddings: bool

    @property
    def layer_params(self) -> int:
        kv = 2 * self.hidden * (self.hidden // self.heads) * self.kv_heads
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return 2 * self.hidden * self.hidden + kv + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params


MODELS: dict[str, ModelPreset] = {
    "llama3-8b": ModelPreset(32, 4096, 14336, 32, 8, 128256, 8192, True, False),
    "llama3-70b": ModelPreset(80, 8192, 28672, 64, 8, 128256, 8192, True, False),
    "llama3-405b": ModelPreset(126, 16384, 53248, 128, 8, 128256, 8192, True, False),
    "gpt2-xl": ModelPreset(48, 1600, 6400, 25, 25, 50257, 1024, False, True),
    "gpt2": ModelPreset(12, 768, 3072, 12, 12, 50257, 1024, False, True),
    "bench-gpt": ModelPreset(6, 512, 2048, 8, 8, 8192, 128, False, True),
}

# Mixture-of-experts presets for --moe, from the models' published configurations. DeepSeek-V3:
# multi-head latent attention of 187.1M parameters a layer (low-rank q of 1536 and kv of 512;
# 128 heads, query and key 192 wide, value 128), 671.0B parameters, 37.6B active, its
# multi-token-prediction module left out. Qwen3-30B-A3B: 32 query and 4 KV heads of 128, 30.5B parameters, 3.35B active.
MOE_MODELS: dict[str, MoEShape] = {
    "deepseek-v3": MoEShape(layers=61, dense_layers=3, hidden=7168, heads=128, vocab=129280, seq=4096,
                            attention_params=187_121_664, dense_ffn=18432, experts=256, top_k=8, expert_ffn=2048,
                            shared_experts=1),
    "qwen3-30b-a3b": MoEShape(layers=48, dense_layers=0, hidden=2048, heads=32, vocab=151936, seq=4096,
                              attention_params=18_878_720, dense_ffn=0, experts=128, top_k=8, expert_ffn=768),
}


@dataclass(frozen=True)
class ClusterPreset:
    nodes: int
    gpus_per_node: int
    peak_flops: float        # dense bf16 FLOP/s per GPU
    memory_bytes: float
    bus_bandwidth: float     # NCCL bus bandwidth of a ring all-gather / reduce-scatter (bytes/s)
    step_latency_intra: float
    step_latency_inter: float
    base_latency: float = 8e-6
    node_bandwidth: float = 370e9     # NVLink bus bandwidth inside a node (bytes/s)

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self) -> LinkModel:
        """NCCL's ring model: base + one latency per step, N-1 steps, of which nodes-1 cross
        the network and the rest stay on NVLink."""
        intra_steps = self.ranks - self.nodes
        alpha = self.base_latency + intra_steps * self.step_latency_intra + (self.nodes - 1) * self.step_latency_inter
        kind = "nvlink" if self.nodes == 1 else self._network_kind
        return LinkModel(kind, alpha, self.bus_bandwidth, "preset")

    @property
    def _network_kind(self) -> str:
        return "infiniband" if self.step_latency_inter < 10e-6 else "ethernet"

    def levels(self) -> Levels:
        """The two levels as `overlap.plan.sharding` sees them, by the same ring model: a
        node's ranks over NVLink, one rank per node over the network, and every rank (`link`)."""
        node = LinkModel("nvlink", self.base_latency + (self.gpus_per_node - 1) * self.step_latency_intra,
                         self.node_bandwidth, "preset")
        network = LinkModel(self._network_kind, self.base_latency + (self.nodes - 1) * self.step_latency_inter,
                            self.bus_bandwidth, "preset")
        return Levels(self.nodes, self.gpus_per_node, node, network, self.link())


H100 = dict(peak_flops=989e12, memory_bytes=80e9)
A100 = dict(peak_flops=312e12, memory_bytes=80e9)
# NVLink: NCCL all-gather bus bandwidth on 8 H100 ≈ 370 GB/s (A100 ≈ 230); per-step latency
# ~1 µs. InfiniBand NDR: one 400 Gb/s NIC per GPU, a ring limited by one NIC ≈ 46 GB/s, ~5 µs
# per network step. Ethernet: one 100 Gb/s NIC per node ≈ 11 GB/s, ~12 µs per network step.
CLUSTERS: dict[str, ClusterPreset] = {
    "8xH100-nvlink": ClusterPreset(1, 8, **H100, bus_bandwidth=370e9, step_latency_intra=1e-6, step_latency_inter=0.0),
    "8xA100-nvlink": ClusterPreset(1, 8, **A100, bus_bandwidth=230e9, step_latency_intra=1e-6, step_latency_inter=0.0,
                                   node_bandwidth=230e9),
    "2x8xH100-ib-ndr": ClusterPreset(2, 8, **H100, bus_bandwidth=46e9, step_latency_intra=1e-6, step_latency_inter=5e-6),
    "4x8xH100-ib-ndr": ClusterPreset(4, 8, **H100, bus_bandwidth=46e9, step_latency_intra=1e-6, step_latency_inter=5e-6),
    "8x8xH100-ib-ndr": ClusterPreset(8, 8, **H100, bus_bandwidth=46e9, step_latency_intra=1e-6, step_latency_inter=5e-6),
    "16x8xH100-ib-ndr": ClusterPreset(16, 8, **H100, bus_bandwidth=46e9, step_latency_intra=1e-6, step_latency_inter=5e-6),
    "32x8xH100-ib-ndr": ClusterPreset(32, 8, **H100, bus_bandwidth=46e9, step_latency_intra=1e-6, step_latency_inter=5e-6),
    "4x8xH100-eth-100g": ClusterPreset(4, 8, **H100, bus_bandwidth=11e9, step_latency_intra=1e-6, step_latency_inter=12e-6),
}


def _unit(name: str, params: int, flops: float = 0.0, rate: float = 1.0) -> UnitCost:
    """A unit of `params` parameters whose forward + backward cost `flops` (backward twice forward)."""
    return UnitCost(name, params * MASTER_BYTES, params * GATHER_BYTES, params * REDUCE_BYTES,
                    flops / 3 / rate, 2 * flops / 3 / rate)


def build_profile(model: ModelPreset, cluster: ClusterPreset, batch: int, mfu: float,
                  head_unit: bool = False) -> Profile:
    """One unit per layer. FLOPs per token: 6 per parameter for forward + backward plus
    12·hidden·seq per layer for attention scores (the convention MFU figures use); backward
    is twice forward. The embeddings, final norm and head form the root; with `head_unit`
    (untied embeddings only) the final norm and head are a unit of their own after the
    layers, as torchtitan wraps Llama, and the root holds the input embedding alone."""
    tokens = batch * model.seq
    rate = cluster.peak_flops * mfu
    layer_flops = tokens * (6 * model.layer_params + 12 * model.hidden * model.seq)
    head_flops = tokens * 6 * model.vocab * model.hidden
    units = [_unit(f"layers.{i}", model.layer_params, layer_flops, rate) for i in range(model.layers)]
    if head_unit and not model.tied_embeddings:
        head_params = model.vocab * model.hidden + model.hidden
        units.append(_unit("output", head_params, head_flops, rate))
        return Profile(tuple(units), cluster.ranks, _unit("root", model.embedding_params - head_params))
    return Profile(tuple(units), cluster.ranks, _unit("root", model.embedding_params), head_flops / rate)


def activations(model: ModelPreset, batch: int, checkpointing: bool) -> float:
    """Activation bytes per rank by `overlap estimate`'s formula, bf16, fused attention, with
    the head's and the loss's."""
    shape = ActivationShape(batch, model.seq, model.hidden, model.layers, model.heads, model.vocab)
    return activation_bytes(shape, GATHER_BYTES, checkpointing)


@dataclass(frozen=True)
class Point:
    depth: int
    bucket_bytes: int          # 0: no merging
    prediction: Prediction
    memory_bytes: float
    tokens_per_s: float


def evaluate(profile: Profile, link: LinkModel, model: ModelPreset, batch: int, depth: int, bucket_bytes: int,
             checkpointing: bool, budget: Optional[int]) -> Point:
    merged = Profile(tuple(merge_costs(profile.units, bucket_bytes)), profile.world_size, profile.root,
                     profile.other_s, profile.reshard_after_forward)
    prediction = predict_step(merged, link, depth, depth, budget)
    largest_reduce = max(u.reduce_bytes for u in merged.units)
    memory = (STATE_BYTES * model.params / profile.world_size + prediction.peak_gathered_bytes
              + largest_reduce + activations(model, batch, checkpointing))
    return Point(depth, bucket_bytes, prediction, memory, batch * model.seq / prediction.step_s)


def planned(profile: Profile, cluster: ClusterPreset, model: ModelPreset, batch: int,
            checkpointing: bool = False) -> Point:
    """The configuration the planner picks for this profile and cluster, evaluated."""
    link = cluster.link()
    budget = gathered_budget(cluster.memory_bytes)
    bucket = choose_bucket_bytes(profile.units, link, cluster.ranks, budget)
    depth, _, _ = choose_depths(
        Profile(tuple(merge_costs(profile.units, bucket)), profile.world_size, profile.root, profile.other_s), link,
        budget)
    return evaluate(profile, link, model, batch, depth, bucket, checkpointing, budget)


def render_timeline(prediction: Prediction, width: int = TIMELINE_WIDTH) -> list[str]:
    """Two lanes, each column a slice of the step: F/B compute, G gather, R reduce, '.' idle."""
    scale = width / max(prediction.step_s, 1e-12)
    lanes = {"compute": ["."] * width, "comm": ["."] * width}
    for span in prediction.timeline:
        mark = {"forward": "F", "backward": "B", "root": "H", "gather": "G", "reduce": "R"}[span.label.split()[0]]
        for column in range(int(span.start * scale), min(width, max(int(span.end * scale), int(span.start * scale) + 1))):
            lanes[span.lane][column] = mark
    return [f"  {lane:<8}|{''.join(cells)}|" for lane, cells in lanes.items()]


def _mb(nbytes: float) -> str:
    return "none" if nbytes == 0 else f"{nbytes / 2**20:.0f}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted({**MODELS, **MOE_MODELS}))
    parser.add_argument("--cluster", required=True, choices=sorted(CLUSTERS))
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of compute (0-1]")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--depth", type=int, default=None, help="only this prefetch depth")
    parser.add_argument("--bucket-mb", type=float, default=None, help="only this bucket size (0: no merging)")
    parser.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes of the cluster's GPUs (default: the preset's); with 2 or more, full, hybrid "
                             "and hpZ sharding are compared")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="compare (dp, tp) splits of the cluster, ZeRO-3 over dp and TP inside a node, at the "
                             "global batch of --batch sequences per GPU (overlap.plan.tensor_parallel)")
    parser.add_argument("--pipeline", action="store_true",
                        help="compare (dp, tp, pp, microbatches, schedule) at one global batch, ZeRO-3 over dp "
                             "inside each pipeline stage (overlap.plan.pipeline), beside published layouts")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step for --pipeline and --tensor-parallel (default: --batch per GPU)")
    parser.add_argument("--microbatch", type=int, default=1, help="sequences per pipeline microbatch")
    parser.add_argument("--moe", action="store_true",
                        help="compare expert-parallel sizes under ZeRO-3 for a mixture-of-experts preset "
                             f"({', '.join(sorted(MOE_MODELS))}), --batch sequences per GPU "
                             "(overlap.plan.expert_parallel), beside published throughput")
    add_offload_arguments(parser)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit through the parser, naming the option, where a value is out of its range."""
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu} is invalid; expected a number in (0, 1]")
    if args.batch < 1 or (args.seq is not None and args.seq < 1):
        parser.error("--batch and --seq must be >= 1")
    if args.depth is not None and args.depth < 0:
        parser.error(f"--depth {args.depth} is invalid; expected an integer >= 0")
    if args.bucket_mb is not None and args.bucket_mb < 0:
        parser.error(f"--bucket-mb {args.bucket_mb} is invalid; expected a number >= 0")
    if args.nodes is not None and args.nodes < 1:
        parser.error(f"--nodes {args.nodes} is invalid; expected an integer >= 1")
    if (args.global_batch is not None and args.global_batch < 1) or args.microbatch < 1:
        parser.error("--global-batch and --microbatch must be >= 1")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    if args.moe or args.model in MOE_MODELS:
        return _moe_main(args, parser)

    model = MODELS[args.model]
    if args.seq is not None:
        model = ModelPreset(**{**model.__dict__, "seq": args.seq})
    cluster = CLUSTERS[args.cluster]
    if args.nodes is not None:
        cluster = replace(cluster, nodes=args.nodes)
    link = cluster.link()
    profile = build_profile(model, cluster, args.batch, args.mfu)
    budget = gathered_budget(cluster.memory_bytes)

    pick = planned(profile, cluster, model, args.batch, args.checkpointing)
    bucket_pick, depth_pick = pick.bucket_bytes, pick.depth
    layer_bytes = model.layer_params * MASTER_BYTES
    depths = [args.depth] if args.depth is not None else list(range(MAX_DEPTH + 1))
    buckets = ([int(args.bucket_mb * 2**20)] if args.bucket_mb is not None
               else sorted({0, bucket_pick, 2 * layer_bytes, 4 * layer_bytes}))

    unit = profile.units[0]
    print(f"model {args.model}: {model.params / 1e9:.2f}B parameters, {model.layers} units of "
          f"{model.layer_params / 1e6:.1f}M ({unit.gather_bytes / 2**20:.0f} MB gathered in bf16), "
          f"batch {args.batch} x seq {model.seq} per rank")
    print(f"cluster {args.cluster}: {cluster.ranks} ranks, {link.describe()}, "
          f"{cluster.peak_flops / 1e12:.0f} TFLOP/s bf16 at MFU {args.mfu:.2f}")
    print(f"per unit: forward {unit.forward_s * 1e3:.2f} ms, backward {unit.backward_s * 1e3:.2f} ms, "
          f"gather {link.time(unit.gather_bytes * (cluster.ranks - 1) / cluster.ranks) * 1e3:.2f} ms; "
          f"embedding/head compute {profile.other_s * 1e3:.1f} ms; gathered-memory budget {budget / 1e9:.0f} GB")
    print()
    print(f"{'depth':>5} {'bucket MB':>9} {'step ms':>9} {'exposed ms':>10} {'comm ms':>9} "
          f"{'mem GB/rank':>11} {'tokens/s/GPU':>12}")
    points = [evaluate(profile, link, model, args.batch, d, b, args.checkpointing, budget)
              for b in buckets for d in depths]
    for p in points:
        mark = "  <- planner" if (p.depth, p.bucket_bytes) == (depth_pick, bucket_pick) else ""
        print(f"{p.depth:>5} {_mb(p.bucket_bytes):>9} {p.prediction.step_s * 1e3:>9.1f} "
              f"{p.prediction.exposed_s * 1e3:>10.1f} {p.prediction.comm_s * 1e3:>9.1f} "
              f"{p.memory_bytes / 1e9:>11.1f} {p.tokens_per_s:>12,.0f}{mark}")
    best = min(points, key=lambda p: p.prediction.step_s)
    print()
    print(f"planner pick: depth {depth_pick}, bucket {_mb(bucket_pick)} MB -> step "
          f"{pick.prediction.step_s * 1e3:.1f} ms, exposed {pick.prediction.exposed_s * 1e3:.1f} ms, "
          f"{pick.tokens_per_s:,.0f} tokens/s/GPU, {pick.memory_bytes / 1e9:.1f} GB/rank "
          f"(best in grid: {best.prediction.step_s * 1e3:.1f} ms)")
    shown = pick if args.depth is None and args.bucket_mb is None else points[0]
    print(f"timeline of depth {shown.depth}, bucket {_mb(shown.bucket_bytes)} MB "
          f"(F/B forward/backward, H embedding+head, G gather, R reduce):")
    for line in render_timeline(shown.prediction):
        print(line)
    if args.offload is not None:
        print()
        for line in offload_summary(args, model, cluster, profile, pick):
            print(line)
    if cluster.nodes > 1:
        print()
        for line in sharding_table(profile, cluster, model, args.batch, args.checkpointing):
            print(line)
    global_batch = args.global_batch or args.batch * cluster.ranks
    if args.tensor_parallel:
        print()
        for line in tensor_parallel_table(model, cluster, global_batch, args.mfu, args.checkpointing):
            print(line)
    if args.pipeline:
        print()
        for line in pipeline_table(args.model, model, cluster, global_batch, args.microbatch, args.mfu,
                                   args.checkpointing):
            print(line)
    return 0


def offload_summary(args: argparse.Namespace, model: ModelPreset, cluster: ClusterPreset, profile: Profile,
                    pick: Point) -> list[str]:
    """The planner's pick with the model states in the tier `--offload` names: bytes per rank
    in each tier, and its step with offload's own time added."""
    rates = offload_rates(args)
    in_flight = pick.memory_bytes - STATE_BYTES * model.params / cluster.ranks
    units = len(profile.units)
    lines = [f"offload (bf16 gathers, AdamW; device adds {in_flight / 1e9:.1f} GB of gathered buffers, "
             "reduce buffer and activations):"]
    lines += offload_lines(args.offload, model.params, cluster.ranks, "bf16", "adamw", rates, units, args.disk_bucket,
                           in_flight)
    t = offload_time(args.offload, model.params, cluster.ranks, "bf16", "adamw", rates, units, args.disk_bucket)
    step = pick.prediction.step_s
    lines.append(f"planner pick with offload {args.offload}: step {(step + t.extra_s) * 1e3:,.1f} ms "
                 f"({(step + t.floor_s) * 1e3:,.1f} ms with the copies hidden), "
                 f"{args.batch * model.seq / (step + t.extra_s):,.0f} tokens/s/GPU")
    return lines


def sharding_table(profile: Profile, cluster: ClusterPreset, model: ModelPreset, batch: int,
                   checkpointing: bool) -> list[str]:
    """Full, hybrid and hpZ sharding on the cluster's two levels, each with the planner's
    bucket and depth, and the option `sharding="auto"` would take (`overlap.plan.sharding`)."""
    levels = cluster.levels()
    budget = gathered_budget(cluster.memory_bytes)
    acts = activations(model, batch, checkpointing)
    largest_reduce = max(u.reduce_bytes for u in profile.units)
    choice = choose_sharding(profile.units, levels, budget, int(cluster.memory_bytes - acts - largest_reduce),
                             profile.other_s, profile.root)
    lines = [f"sharding on {levels.nodes} nodes x {levels.local} GPUs: inside {levels.node.describe()}, "
             f"across {levels.network.describe()}",
             f"{'sharding':>8} {'depth':>5} {'bucket MB':>9} {'step ms':>9} {'exposed ms':>10} {'mem GB/rank':>11} "
             f"{'tokens/s/GPU':>12}"]
    for option in choice.options:
        p = option.prediction
        mark = "  <- sharding=auto" if option is choice.pick else ""
        lines.append(f"{option.sharding:>8} {option.depth:>5} {_mb(option.bucket_bytes):>9} {p.step_s * 1e3:>9.1f} "
                     f"{p.exposed_s * 1e3:>10.1f} {(option.memory_bytes + largest_reduce + acts) / 1e9:>11.1f} "
                     f"{batch * model.seq / p.step_s:>12,.0f}{mark}")
    return lines


def _cluster_shape(cluster: ClusterPreset, mfu: float) -> ClusterShape:
    """The cluster as the plan's split arithmetic (tensor, pipeline, expert parallel) sees it."""
    node = LinkModel("nvlink", cluster.step_latency_intra, cluster.node_bandwidth, "preset")
    return ClusterShape(cluster.nodes, cluster.gpus_per_node, cluster.peak_flops * mfu, cluster.memory_bytes, node,
                        cluster.step_latency_inter, cluster.bus_bandwidth, cluster.base_latency)


def _shapes(model: ModelPreset, cluster: ClusterPreset, mfu: float) -> tuple[TransformerShape, ClusterShape]:
    """The model and cluster as overlap.plan.tensor_parallel and overlap.plan.pipeline see them."""
    shape = TransformerShape(model.layers, model.hidden, model.heads, model.kv_heads, model.vocab, model.seq,
                             model.layer_params, model.embedding_params)
    return shape, _cluster_shape(cluster, mfu)


def tensor_parallel_table(model: ModelPreset, cluster: ClusterPreset, global_batch: int, mfu: float,
                          checkpointing: bool) -> list[str]:
    """Each (dp, tp) split of the cluster at one global batch: TP's all-reduces per step, the
    step with ZeRO-3's gathers over dp (prefetch depth 1), memory per rank, and the pick."""
    shape, machines = _shapes(model, cluster, mfu)
    options = tp_options(shape, machines, global_batch, depth=1, checkpointing=checkpointing)
    pick = choose_tp(options, cluster.memory_bytes)
    lines = [f"tensor parallel x ZeRO-3 at a global batch of {global_batch} sequences "
             f"({'with' if checkpointing else 'without'} activation checkpointing):",
             f"{'dp':>4} {'tp':>3} {'seq/group':>9} {'TP ms':>9} {'exposed ms':>10} {'step ms':>9} "
             f"{'mem GB/rank':>11} {'tokens/s/GPU':>12}"]
    for option in options:
        mark = "  <- pick" if option is pick else ("" if option.memory_bytes <= cluster.memory_bytes else "  (does not fit)")
        lines.append(f"{option.dp:>4} {option.tp:>3} {option.sequences_per_group:>9} {option.tp_comm_s * 1e3:>9.1f} "
                     f"{option.prediction.exposed_s * 1e3:>10.1f} {option.step_s * 1e3:>9.1f} "
                     f"{option.memory_bytes / 1e9:>11.1f} "
                     f"{global_batch * model.seq / cluster.ranks / option.step_s:>12,.0f}{mark}")
    if not options:
        lines.append("no tp divides the node's GPUs and the heads with a whole batch per dp group")
    elif pick is None:
        lines.append("no split fits the memory; try --checkpointing or a smaller --batch")
    return lines


PIPELINE_ROWS = 10      # the fastest options that fit, shown


def _pipeline_row(option: PipelineOption, tokens_per_step: float, ranks: int, mark: str) -> str:
    layout = option.layout
    schedule = layout.schedule + (f" v{layout.virtual}" if layout.virtual > 1 else "")
    return (f"{layout.dp:>4} {layout.tp:>3} {layout.pp:>3} {option.microbatches:>4} {schedule:<18} "
            f"{'kept' if option.kept else 'per mb':>7} {option.bubble:>6.1%} {option.p2p_s * 1e3:>8.0f} "
            f"{option.zero_exposed_s * 1e3:>9.0f} {option.step_s:>8.2f} {option.memory_bytes / 1e9:>7.1f} "
            f"{tokens_per_step / ranks / option.step_s:>9,.0f}{mark}")


def pipeline_table(name: str, model: ModelPreset, cluster: ClusterPreset, global_batch: int, microbatch: int,
                   mfu: float, checkpointing: bool) -> list[str]:
    """The fastest (dp, tp, pp, microbatches, schedule) layouts that fit at one global batch,
    the pick, and the published layouts for this model evaluated the same way."""
    shape, machines = _shapes(model, cluster, mfu)
    options = pipeline_options(shape, machines, global_batch, microbatch, checkpointing)
    pick = choose_pipeline(options, cluster.memory_bytes)
    tokens = global_batch * model.seq
    flops_per_token = 6 * model.params + 12 * model.layers * model.hidden * model.seq
    lines = [f"pipeline x tensor parallel x ZeRO-3 at a global batch of {global_batch} sequences, microbatches of "
             f"{microbatch} ({'with' if checkpointing else 'without'} activation checkpointing):",
             f"{'dp':>4} {'tp':>3} {'pp':>3} {'mbs':>4} {'schedule':<18} {'gathers':>7} {'bubble':>6} "
             f"{'p2p ms':>8} {'ZeRO ms':>9} {'step s':>8} {'GB/rank':>7} {'tok/s/GPU':>9}"]
    fitting = sorted((o for o in options if o.memory_bytes <= cluster.memory_bytes), key=lambda o: o.step_s)
    for option in fitting[:PIPELINE_ROWS]:
        lines.append(_pipeline_row(option, tokens, cluster.ranks, "  <- pick" if option is pick else ""))
    if pick is None:
        lines.append("no layout fits the memory; try --checkpointing or a smaller --microbatch")
    for recipe in (r for r in PUBLISHED if r.model == name):
        lines.append(f"published: {recipe.source}: tp {recipe.tp}, pp {recipe.pp}, {recipe.virtual} stage(s) per "
                     f"rank, context parallel {recipe.context_parallel}, {recipe.gpus} GPUs, global batch "
                     f"{recipe.global_batch}"
                     + (f", {recipe.throughput_tflops:.0f} TFLOP/s per GPU"
                        f" ({recipe.throughput_tflops * 1e12 / flops_per_token:,.0f} tok/s/GPU)"
                        if recipe.throughput_tflops else ""))
        dp = cluster.ranks // (recipe.tp * recipe.pp)
        if dp < 1 or cluster.ranks % (recipe.tp * recipe.pp) or global_batch % (dp * microbatch):
            lines.append(f"  its tp x pp does not divide this cluster's {cluster.ranks} GPUs and global batch")
            continue
        schedule = "Interleaved1F1B" if recipe.virtual > 1 else "1F1B"
        option = evaluate_pipeline(shape, machines, global_batch,
                                   PipelineLayout(dp, recipe.tp, recipe.pp, microbatch, schedule, recipe.virtual),
                                   checkpointing)
        fits = "" if option.memory_bytes <= cluster.memory_bytes else "  (does not fit)"
        lines.append("  here: " + _pipeline_row(option, tokens, cluster.ranks, fits).lstrip()
                     + ("  (context parallelism left out)" if recipe.context_parallel > 1 else ""))
    return lines


# What `--moe` leaves out, printed under its table (docs/moe.md says the same); what each
# published run did that the model does not price is in overlap.cli.published.
MOE_LEFT_OUT = (
    "one MFU for every layout and matrix size (an expert's few hundred tokens run slower GEMMs than a dense layer's)",
    "load imbalance: routing is taken as balanced, every rank's experts get tokens x top_k pairs",
    "the all-to-all and ZeRO-3's collectives sharing a NIC: each is priced as if alone on it",
    "the all-to-all's own kernels slowing the expert GEMMs they overlap (both are priced at full speed)",
    "causal attention's halved score FLOPs, multi-head latent attention's wider activations, the optimizer step",
)


def _moe_row(option: EpOption, fits: bool, mark: str) -> str:
    return (f"{option.ep:>3} {option.dp:>3} {option.a2a_bytes_per_layer / 2**20:>9,.0f} {option.a2a_network_share:>8.0%} "
            f"{option.a2a_s * 1e3:>8.0f} {option.a2a_exposed_s * 1e3:>8.0f} {option.a2a_hidden_s * 1e3:>8.0f} "
            f"{option.zero_exposed_s * 1e3:>8.0f} {option.step_s * 1e3:>8.0f} {option.memory_bytes / 1e9:>7.1f} "
            f"{option.tokens_per_s:>9,.0f}{mark if fits else '  (does not fit)'}")


def _moe_published(name: str) -> list[str]:
    """Published throughput for the preset, each with what the model leaves out of that run."""
    runs = [p for p in PUBLISHED_MOE if p.model == name]
    lines = [f"published: {p.source}: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU ({p.setup}); not priced here: "
             f"{p.not_priced}" for p in runs]
    return lines or ["published: no throughput figure found for this model"]


def _moe_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`--moe`: refuse what it does not price, then print its table."""
    if args.model not in MOE_MODELS:
        parser.error(f"--moe takes a mixture-of-experts preset ({', '.join(sorted(MOE_MODELS))}); "
                     f"{args.model} is dense")
    if not args.moe:
        parser.error(f"--model {args.model} is a mixture-of-experts preset; add --moe")
    others = [flag for flag, value in (("--tensor-parallel", args.tensor_parallel), ("--pipeline", args.pipeline),
                                       ("--offload", args.offload), ("--depth", args.depth),
                                       ("--bucket-mb", args.bucket_mb), ("--global-batch", args.global_batch))
              if value not in (None, False)]
    if others:
        parser.error(f"--moe prices expert parallelism alone; it does not take {', '.join(others)}")
    for line in moe_table(args):
        print(line)
    return 0


def moe_table(args: argparse.Namespace) -> list[str]:
    """Each expert-parallel size of the cluster for a mixture-of-experts preset: the all-to-all
    (bytes, off-node share, time exposed and hidden by the two-half overlap), ZeRO-3's exposed
    collectives, the step, memory per rank, the pick, and published throughput beside it."""
    model = MOE_MODELS[args.model]
    if args.seq is not None:
        model = replace(model, seq=args.seq)
    cluster = CLUSTERS[args.cluster] if args.nodes is None else replace(CLUSTERS[args.cluster], nodes=args.nodes)
    machines = _cluster_shape(cluster, args.mfu)
    options = ep_options(model, machines, args.batch, args.checkpointing)
    pick = choose_ep(options, cluster.memory_bytes)
    lines = [f"expert parallel x ZeRO-3: {args.model}, {model.params / 1e9:.1f}B parameters "
             f"({model.active_params / 1e9:.2f}B active, {model.moe_layers} MoE layers of {model.experts} experts, "
             f"top-{model.top_k}), {args.batch} x {model.seq} tokens per GPU, {cluster.nodes} x "
             f"{cluster.gpus_per_node} GPUs, MFU {args.mfu:.2f} ({'with' if args.checkpointing else 'without'} "
             "activation checkpointing):",
             f"{'ep':>3} {'dp':>3} {'a2a MB/l':>9} {'off-node':>8} {'a2a ms':>8} {'exposed':>8} {'hidden':>8} "
             f"{'ZeRO ms':>8} {'step ms':>8} {'GB/rank':>7} {'tok/s/GPU':>9}"]
    lines += [_moe_row(o, o.memory_bytes <= cluster.memory_bytes, "  <- pick" if o is pick else "") for o in options]
    if pick is None:
        nodes = nodes_to_fit(model, machines, args.batch, args.checkpointing)
        lines.append(f"no expert-parallel size fits {cluster.memory_bytes / 1e9:.0f} GB per GPU (model states alone: "
                     f"{STATE_BYTES * model.params / machines.ranks / 1e9:.0f} GB per rank); "
                     + (f"one fits at --nodes {nodes}" if nodes else "none fits up to 1024 nodes")
                     + ("" if args.checkpointing else " (or try --checkpointing)"))
    lines += _moe_published(args.model)
    lines += ["left out:"] + [f"  - {item}" for item in MOE_LEFT_OUT]
    return lines
