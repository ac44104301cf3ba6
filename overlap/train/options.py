"""`overlap train`'s command line: the options, their parsing, and the checks made before
any rank starts, each naming the option that is wrong."""
from __future__ import annotations

import argparse
import os
from importlib import resources
from typing import Callable, Optional

import torch
import torch.distributed as dist

from overlap.base.choices import COMPRESS_CHOICES, OFFLOAD_CHOICES
from overlap.base.config import config_from_env

DEFAULT_TEXT = "coriolanus.txt"
VAL_FRACTION = 0.1
# torch.distributed.pipelining's Schedule<name>: one stage per rank, then two per rank
# (stages r and r + pp; under the V-shaped ones r and 2 pp - 1 - r).
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages each rank holds under `schedule`."""
    return 1 if schedule in ("1F1B", "GPipe") else 2


class JobError(ValueError):
    """A setting or a checkpoint the job cannot run with; every rank raises it, and the job
    exits with status 2 printing it."""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:          # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlap train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=_positive_int, default=4, help="transformer blocks (default 4)")
    model.add_argument("--hidden", type=_positive_int, default=128, help="embedding width (default 128)")
    model.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    model.add_argument("--seq", type=_positive_int, default=64, help="context length in bytes (default 64)")
    model.add_argument("--moe", action="store_true",
                       help="mixture-of-experts MLPs (overlap.models.moe: top-k router, SwiGLU experts)")
    model.add_argument("--experts", type=_positive_int, default=8, help="experts per MoE layer (default 8)")
    model.add_argument("--top-k", type=_positive_int, default=2, help="experts each token goes to (default 2)")
    model.add_argument("--expert-parallel", type=_positive_int, default=None, metavar="E",
                       help="split each MoE layer's experts across E ranks (tokens reach them by all-to-all); "
                            "needs --moe")
    model.add_argument("--capacity-factor", type=_positive_float, default=None, metavar="C",
                       help="each expert takes at most ceil(C * tokens * top-k / experts) pairs per forward, first "
                            "choices first, the rest dropped (default: dropless); needs --moe")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--schedule-steps", type=_positive_int, default=None, metavar="N",
                       help="steps the learning-rate schedule spans (default: --steps); a run stopped early "
                            "this way continues exactly when started again with --steps N")
    train.add_argument("--batch", type=_positive_int, default=16,
                       help="sequences per batch shard (default 16); the global batch is --batch times the "
                            "world size of the run's first start, whatever the world size later")
    train.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    train.add_argument("--eval-every", type=_positive_int, default=50,
                       help="steps between train/val loss lines (default 50)")
    train.add_argument("--weight-decay", type=float, default=0.1,
                       help="AdamW weight decay on embedding and linear weights; none on norms and biases (default 0.1)")
    train.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and sampling")
    train.add_argument("--data", default=None,
                       help=f"a text file to train on (default: the shipped {DEFAULT_TEXT})")
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--world-size", type=_positive_int, default=None,
                         help="ranks to start (default: 2 on CPU, every local GPU); under torchrun, torchrun's")
    runtime.add_argument("--mixed-precision", choices=("fp32", "bf16"), default="fp32",
                         help="bf16 gathers parameters and reduces gradients in bfloat16 (default fp32)")
    runtime.add_argument("--eager-init", action="store_true",
                         help="build the whole model on every rank before sharding it (default: build on the "
                              "meta device and materialise only each rank's parts; same values)")
    runtime.add_argument("--compress", choices=COMPRESS_CHOICES, default=None,
                         help="quantise weights / gradients on the wire (default: OVERLAP_COMPRESS, else none)")
    runtime.add_argument("--offload", choices=OFFLOAD_CHOICES, default=None,
                         help="where master shards, gradients and optimizer state live (default: OVERLAP_OFFLOAD, "
                              "else none; docs/offload.md); disk needs --mixed-precision bf16 and steps with "
                              "overlap.optim.AdamW")
    runtime.add_argument("--compile", action="store_const", const=True, default=None,
                         help="compile each block's compute with torch.compile (default: OVERLAP_COMPILE, else "
                              "eager; docs/compile.md)")
    runtime.add_argument("--prefetch-depth", type=_non_negative_int, default=None,
                         help="units gathered ahead (default: the planner's choice)")
    runtime.add_argument("--bucket-mb", type=_positive_float, default=None,
                         help="merge consecutive units up to this size (default: the planner's choice)")
    pipeline = parser.add_argument_group("pipeline parallel")
    pipeline.add_argument("--pp", type=_int_at_least(2), default=None, metavar="N",
                          help="cut the model into N pipeline stages, each sharded over world/N ranks with "
                               "overlap.fully_shard and driven by torch's pipeline schedule (docs/pipeline.md)")
    pipeline.add_argument("--pp-schedule", choices=PP_SCHEDULES, default=None,
                          help=f"the schedule under --pp (default {PP_SCHEDULES[0]}); all but 1F1B and GPipe hold "
                               "two stages per rank (docs/pipeline.md)")
    pipeline.add_argument("--microbatches", type=_positive_int, default=None, metavar="M",
                          help="microbatches of each --batch under --pp (default: N); M must divide --batch")
    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                             help="resume from the newest complete checkpoint in DIR, if any, and save "
                                  "into DIR/step-<8 digits> at the last step")
    checkpoints.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="N",
                             help="also save every N steps, in the background (needs --checkpoint-dir)")
    output = parser.add_argument_group("output")
    output.add_argument("--trace", metavar="DIR", default=None,
                        help="write a Chrome trace per rank and timeline.png of one step into DIR")
    output.add_argument("--sample", type=_non_negative_int, default=0, metavar="N",
                        help="print N generated samples at the end (default 0)")
    output.add_argument("--sample-len", type=_positive_int, default=200, help="bytes per sample (default 200)")
    return parser


def read_text(path: Optional[str]) -> tuple[str, bytes]:
    """The name and bytes of the text trained on."""
    if path is None:
        return DEFAULT_TEXT, resources.files("overlap").joinpath("data").joinpath(DEFAULT_TEXT).read_bytes()
    try:
        with open(path, "rb") as f:
            return os.path.basename(path), f.read()
    except OSError as exc:
        raise JobError(f"--data {path!r} cannot be read: {exc.strerror}") from None


def offload_tier(args: argparse.Namespace) -> str:
    """--offload, else OVERLAP_OFFLOAD, else none: the tier the model will be wrapped with."""
    return args.offload if args.offload is not None else config_from_env().offload


def check_options(args: argparse.Namespace) -> None:
    """Reject settings that cannot work, naming the option."""
    if args.hidden % args.heads:
        raise JobError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    name, text = read_text(args.data)
    shortest = int(len(text) * VAL_FRACTION)
    if shortest < args.seq + 1:
        raise JobError(f"--seq {args.seq} is too long for {name} ({len(text)} bytes; the validation split "
                       f"has {shortest}); use a shorter --seq or a longer text")
    if offload_tier(args) == "disk" and args.mixed_precision != "bf16":
        raise JobError("--offload disk keeps the fp32 masters in a file and only the 16-bit copy the gathers send "
                       f"in memory: it needs --mixed-precision bf16 (got {args.mixed_precision})")
    compression = f"--compress {args.compress}" if args.compress is not None else \
        f"OVERLAP_COMPRESS={config_from_env().compress}"
    if offload_tier(args) == "disk" and not compression.endswith("none"):
        raise JobError(f"--offload disk with {compression} is not supported: the codecs encode the fp32 master "
                       "shard, which the disk tier keeps in its state file; use --compress none")
    for name, value in (("--expert-parallel", args.expert_parallel), ("--capacity-factor", args.capacity_factor)):
        if not args.moe and value is not None:
            raise JobError(f"{name} {value} needs --moe")
    if args.moe and args.top_k > args.experts:
        raise JobError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.expert_parallel is not None and args.experts % args.expert_parallel:
        raise JobError(f"--expert-parallel {args.expert_parallel} must divide --experts {args.experts}")
    check_pipeline(args)
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise JobError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir")
    if args.checkpoint_dir is not None:
        try:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
        except OSError as exc:
            raise JobError(f"--checkpoint-dir {args.checkpoint_dir!r} cannot be made: "
                           f"{exc.strerror or exc}") from None
    launching = not dist.is_torchelastic_launched()
    if launching and args.world_size and torch.cuda.is_available() and args.world_size > torch.cuda.device_count():
        raise JobError(f"--world-size {args.world_size} exceeds the {torch.cuda.device_count()} local GPUs")


def check_pipeline(args: argparse.Namespace) -> None:
    """--pp's settings, their defaults filled in, and the options it does not take yet, each
    named (before the ranks start, and again by each rank)."""
    if args.pp is None:
        for name, value in (("--pp-schedule", args.pp_schedule), ("--microbatches", args.microbatches)):
            if value is not None:
                raise JobError(f"{name} needs --pp")
        return
    args.pp_schedule = args.pp_schedule or PP_SCHEDULES[0]
    args.microbatches = args.microbatches or args.pp
    stages = args.pp * stages_per_rank(args.pp_schedule)
    if args.layers < stages:
        raise JobError(f"--pp {args.pp} with --pp-schedule {args.pp_schedule} makes {stages} stages and needs at "
                       f"least as many --layers (got {args.layers}): every stage holds a block")
    if args.batch % args.microbatches:
        raise JobError(f"--microbatches {args.microbatches} must divide --batch {args.batch}")
    if args.pp_schedule == "1F1B" and args.microbatches < args.pp:
        raise JobError(f"--pp-schedule 1F1B needs --microbatches >= --pp {args.pp} (got {args.microbatches})")
    # torch's own conditions on these schedules, named before any rank builds one.
    if args.pp_schedule == "DualPipeV" and args.microbatches < stages:
        raise JobError(f"--pp-schedule DualPipeV needs --microbatches >= its {stages} stages (got {args.microbatches})")
    rounds = max(1, args.microbatches // args.pp)
    if args.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and args.microbatches % rounds:
        raise JobError(f"--pp-schedule {args.pp_schedule} runs its microbatches in max(1, M // --pp) = {rounds} "
                       f"rounds: --microbatches {args.microbatches} must be a multiple of that")
    if offload_tier(args) == "disk":
        raise JobError("offload disk with --pp is not supported yet: the disk tier steps with overlap.optim.AdamW "
                       "over a ShardedModule's parameters; use --offload cpu")


def check_world_size(args: argparse.Namespace, world: int) -> None:
    """Under torchrun, --world-size (if given) must be the world torchrun started; --pp must
    divide the world, and --expert-parallel the ranks that hold a stage (world/pp, or the world)."""
    if args.world_size is not None and args.world_size != world:
        raise JobError(f"--world-size {args.world_size} but torchrun started {world} ranks; leave --world-size "
                       "out under torchrun, or make it match")
    if args.pp is not None and world % args.pp:
        raise JobError(f"--pp {args.pp} must divide the world size {world}: each stage runs on world/pp ranks")
    if args.expert_parallel is not None:
        holders = world if args.pp is None else world // args.pp
        if holders % args.expert_parallel:
            where = f"the world size {world}" if args.pp is None else \
                f"the {holders} ranks that hold each stage (world {world} / --pp {args.pp})"
            raise JobError(f"--expert-parallel {args.expert_parallel} must divide {where}: the experts split over "
                           "groups of that many of them")
