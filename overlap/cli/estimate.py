"""`overlap estimate`: per-rank memory of a model under DP and ZeRO-1/2/3, from formulas.

    overlap estimate --params 7e9 --world 64 --precision bf16 --optimizer adamw --stage zero3 \\
        --seq 4096 --batch 8 --layers 32 --hidden 4096 [--ckpt] [--prefetch-depth 1] [--tp 8] \\
        [--offload cpu|disk [--host-gbps 25] [--disk-gbps 3] [--cpu-update-rate 1e9]]

With --offload, the model states per rank in each tier (device, host, disk) and the time the
tier adds to a step (`overlap.plan.offload`); bandwidths default to the link table's,
then OVERLAP_HOST_GBPS / OVERLAP_DISK_GBPS, then these flags.

GB here is 10^9 bytes, as in the ZeRO paper. See `overlap.plan.memory` for the formulas.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable, Optional, Sequence

from overlap.base.choices import OFFLOAD_CHOICES
from overlap.base.config import config_from_env
from overlap.plan.memory import (MASTER_BYTES, MODEL_STATE_CATEGORIES, OPTIMIZERS, PRECISIONS, STAGES, ActivationShape, MemoryEstimate, estimate, formula, state_bytes, wrap_peak_bytes)
from overlap.plan.tensor_parallel import tensor_parallel_share
from overlap.plan.offload import DISK_BUCKET_PARAMS, TierRates, offload_time, rates_with, tier_bytes
from overlap.observe.memory import format_amount, format_table

GB = 1e9
_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_SHAPE_ARGS = ("seq", "batch", "layers", "hidden")
HEAD_SIZE = 128  # default head size when --heads is not given


def parameter_count(text: str) -> float:
    """'7e9', '7B', '125M', '350k' -> a count > 0."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    try:
        value = float(match.group(1)) * _SUFFIXES[match.group(2)] if match else float("nan")
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a parameter count > 0 such as 7e9 or 7B, got {text!r}")
    return value


def _integer_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap estimate",
                                     description="Per-rank memory (GB = 1e9 bytes) under DP / ZeRO-1/2/3.")
    positive = _integer_at_least(1)
    parser.add_argument("--params", type=parameter_count, required=True, help="parameter count Ψ (7e9, 7B)")
    parser.add_argument("--world", type=positive, required=True, help="data-parallel ranks N")
    parser.add_argument("--tp", type=positive, default=1,
                        help="tensor-parallel degree: each rank holds 1/tp of every parameter (torchtitan's plan) and "
                             "of the activations (sequence parallelism); --world counts the dp ranks")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="bf16/fp16: mixed precision with fp32 master weights; fp32: everything fp32")
    parser.add_argument("--stage", choices=STAGES, default="zero3")
    parser.add_argument("--seq", type=positive, help="sequence length")
    parser.add_argument("--batch", type=positive, help="micro-batch per rank (sequences)")
    parser.add_argument("--layers", type=positive, help="transformer layers")
    parser.add_argument("--hidden", type=positive, help="hidden size")
    parser.add_argument("--heads", type=positive, help=f"attention heads (default: hidden / {HEAD_SIZE})")
    parser.add_argument("--vocab", type=_integer_at_least(0), default=0,
                        help="vocabulary size, to count the head and loss activations (default: left out)")
    parser.add_argument("--attention", choices=("fused", "eager"), default="fused",
                        help="eager keeps each head's s x s softmax for backward")
    parser.add_argument("--ckpt", action="store_true", help="activation checkpointing of every layer")
    parser.add_argument("--prefetch-depth", type=_integer_at_least(0), default=1,
                        help="units gathered ahead of the one computing (ZeRO-3)")
    parser.add_argument("--largest-unit", type=parameter_count,
                        help="parameters of the largest unit (default: params / layers)")
    parser.add_argument("--root-params", type=parameter_count,
                        help="parameters outside every unit, gathered all step (default: 0)")
    add_offload_arguments(parser)
    return parser


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """--offload and the rates it is priced at (shared with `overlap simulate`)."""
    parser.add_argument("--offload", choices=OFFLOAD_CHOICES,
                        help="price keeping master, gradient and optimizer shards in host memory (cpu) or on "
                             "disk, next to the device (none)")
    parser.add_argument("--host-gbps", type=_positive_number,
                        help="device <-> host copy bandwidth, GB/s (default: OVERLAP_HOST_GBPS or 25)")
    parser.add_argument("--disk-gbps", type=_positive_number,
                        help="disk bandwidth, GB/s (default: OVERLAP_DISK_GBPS or 3)")
    parser.add_argument("--cpu-update-rate", type=parameter_count,
                        help="CPU AdamW parameters per second per rank (default: 1e9)")
    parser.add_argument("--disk-bucket", type=parameter_count, default=float(DISK_BUCKET_PARAMS),
                        help=f"parameters per disk bucket (default: {DISK_BUCKET_PARAMS})")


def offload_rates(args: argparse.Namespace) -> TierRates:
    """Flags beat OVERLAP_HOST_GBPS / OVERLAP_DISK_GBPS, which beat the link table."""
    config = config_from_env()
    return rates_with(args.host_gbps if args.host_gbps is not None else config.host_gbps,
                      args.disk_gbps if args.disk_gbps is not None else config.disk_gbps,
                      args.cpu_update_rate)


def offload_lines(offload: str, params: float, world: int, precision: str, optimizer: str, rates: TierRates,
                  units: int, bucket_params: float, in_flight: float = 0.0) -> list[str]:
    """Every tier's bytes per rank (the chosen one marked) and the chosen tier's time per step."""
    rows = [("offload", "device GB", "host GB", "disk GB")]
    for tier in OFFLOAD_CHOICES:
        b = tier_bytes(tier, params, world, precision, optimizer, bucket_params)
        rows.append((tier + ("  <-" if tier == offload else ""), format_amount(b.device + in_flight, GB),
                     format_amount(b.host, GB), format_amount(b.disk, GB)))
    t = offload_time(offload, params, world, precision, optimizer, rates, units, bucket_params)
    lines = format_table(rows).splitlines()
    if offload != "none":
        io = (f", disk IO {t.io_s * 1e3:,.1f} ms at {rates.disk.beta / 1e9:g} GB/s (read + write, pipelined with "
              "the update)" if offload == "disk" else "")
        lines.append(f"offload {offload} adds per step: copies {t.copy_s * 1e3:,.1f} ms over the host link at "
                     f"{rates.host.beta / 1e9:g} GB/s, CPU AdamW {t.update_s * 1e3:,.1f} ms at "
                     f"{rates.update_params_per_s:,.3g} params/s{io} -> {t.extra_s * 1e3:,.1f} ms, "
                     f"{t.floor_s * 1e3:,.1f} ms if the copies hide under backward and forward")
    return lines


def _activation_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[ActivationShape]:
    given = [name for name in _SHAPE_ARGS if getattr(args, name) is not None]
    if not given:
        if args.heads is not None or args.vocab or args.ckpt:
            parser.error("--heads, --vocab and --ckpt need --seq, --batch, --layers and --hidden")
        return None
    missing = [f"--{name}" for name in _SHAPE_ARGS if name not in given]
    if missing:
        parser.error(f"--seq, --batch, --layers and --hidden go together; missing {', '.join(missing)}")
    heads = args.heads if args.heads is not None else (
        args.hidden // HEAD_SIZE if args.hidden % HEAD_SIZE == 0 else 1)
    if args.hidden % heads:
        parser.error(f"argument --heads: {heads} does not divide --hidden {args.hidden}")
    return ActivationShape(args.batch, args.seq, args.hidden, args.layers, heads, args.vocab,
                           fused_attention=args.attention == "fused")


def _stage_table(args: argparse.Namespace, result: MemoryEstimate, shape: Optional[ActivationShape]) -> str:
    per_param = state_bytes(args.precision, args.optimizer)
    rows = [("category", "formula", "GB")]
    for category in MODEL_STATE_CATEGORIES:
        rows.append((category.replace("_", " "), formula(args.stage, per_param, category),
                     format_amount(getattr(result, category), GB)))
    act_formula = "-" if shape is None else ("L x layer input + 1 layer" if args.ckpt else "L x layer")
    rows.append(("activations", act_formula, format_amount(result.activations, GB)))
    gathered_formula = f"{args.prefetch_depth + 1} x unit + root" if args.stage == "zero3" else "0 (unsharded)"
    rows.append(("gathered buffers", gathered_formula, format_amount(result.gathered_buffers, GB)))
    rows.append(("total", "", format_amount(result.total, GB)))
    return format_table(rows)


def _comparison_table(results: dict[str, MemoryEstimate]) -> str:
    rows = [("category", *results)]
    for category in (*MODEL_STATE_CATEGORIES, "activations", "gathered_buffers", "total"):
        amounts = (format_amount(getattr(result, category), GB) for result in results.values())
        rows.append((category.replace("_", " "), *amounts))
    return format_table(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shape = _activation_shape(parser, args)
    if args.offload is not None and args.stage != "zero3":
        parser.error("--offload is priced for ZeRO-3 shards (--stage zero3)")
    tp = args.tp
    results = {stage: tensor_parallel_share(estimate(
        args.params / tp, args.world, stage=stage, precision=args.precision, optimizer=args.optimizer,
        activations=shape, checkpointing=args.ckpt, prefetch_depth=args.prefetch_depth,
        largest_unit_params=None if args.largest_unit is None else args.largest_unit / tp,
        root_params=(args.root_params or 0.0) / tp), tp) for stage in STAGES}
    regime = "fp32" if args.precision == "fp32" else f"{args.precision} mixed precision"
    split = "" if tp == 1 else (f" per tp rank (1/{tp} of the model's {args.params:,.0f}; the activations 1/{tp} too, "
                                "by sequence parallelism)")
    print(f"Ψ = {args.params / tp:,.0f} parameters{split}, N = {args.world} ranks, {regime}, {args.optimizer}, "
          f"stage {args.stage}; per rank, GB = 1e9 bytes")
    print(_stage_table(args, results[args.stage], shape))
    if shape is None:
        print("activations: give --seq, --batch, --layers and --hidden to estimate them")
    if results["zero3"].gathered_buffers is None:
        print("gathered buffers: give --layers (with the shape) or --largest-unit to estimate them")
    largest = args.largest_unit or (args.params / args.layers if args.layers else None)
    if largest is None:
        print("wrapping: give --layers or --largest-unit to estimate its peak")
    else:
        eager, meta = (wrap_peak_bytes(args.params, args.world, largest, on_meta) for on_meta in (False, True))
        print(f"wrapping (fp32 build), peak per rank: {format_amount(eager, GB)} GB built eagerly "
              f"(4Ψ + 4Ψ/N + unit), {format_amount(meta, GB)} GB built on the meta device (4Ψ/N + unit)")
    print("\nevery stage, GB per rank")
    print(_comparison_table(results))
    if args.precision != "fp32":
        moments = state_bytes(args.precision, args.optimizer).optimizer_state - MASTER_BYTES
        print(f"\noverlap's ZeRO-3 runtime keeps the fp32 master copy as the shard itself: it splits the "
              f"same total as {MASTER_BYTES}Ψ/N weights + {MASTER_BYTES}Ψ/N gradients + {moments:g}Ψ/N "
              "optimizer state.")
    if args.offload is not None:
        chosen = results["zero3"]
        in_flight = (chosen.activations or 0.0) + (chosen.gathered_buffers or 0.0)
        known = (f"device adds the {format_amount(in_flight, GB)} GB of activations and gathered buffers estimated "
                 "above" if in_flight else "activations and gathered buffers, not estimated, come on top on the device")
        print(f"\nmodel states per rank by offload tier ({known})")
        for line in offload_lines(args.offload, args.params, args.world, args.precision, args.optimizer,
                                  offload_rates(args), args.layers or 1, args.disk_bucket, in_flight):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
