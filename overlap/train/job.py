"""`overlap train`: train a small byte-level GPT with ShardedModule on a text shipped in the
package and report how much of the communication was hidden.

Run on its own it starts its ranks itself through torchrun's launcher API (2 gloo ranks on
CPU, one nccl rank per local GPU); launched by torchrun it runs as one of torchrun's ranks.

With --checkpoint-dir it saves sharded checkpoints there in the background and, started
again (by hand or by `torchrun --max-restarts`), resumes from the newest complete one with
the same batches, learning rates and losses as a run that was never interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import math
import os
import resource
import statistics
import sys
import time
import uuid
from importlib import resources
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from overlap.base.choices import COMPRESS_CHOICES, OFFLOAD_CHOICES

if TYPE_CHECKING:
    from tqdm import tqdm

DEFAULT_TEXT = "coriolanus.txt"
VOCAB_SIZE = 256          # byte-level tokens: any text works, nothing to download
VAL_FRACTION = 0.1
VAL_BATCHES = 4           # the same validation batches at every evaluation
HIDDEN_EVERY = 10         # steps between readings of the hidden share the progress bar shows


def _int_at_least(minimum: int):
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
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlap train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=_positive_int, default=4, help="transformer blocks (default 4)")
    model.add_argument("--hidden", type=_positive_int, default=128, help="embedding width (default 128)")
    model.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    model.add_argument("--seq", type=_positive_int, default=64, help="context length in bytes (default 64)")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--schedule-steps", type=_positive_int, default=None, metavar="N",
                       help="steps the learning-rate schedule spans (default: --steps); a run stopped early "
                            "this way continues exactly when started again with --steps N")
    train.add_argument("--batch", type=_positive_int, default=16, help="sequences per rank per step (default 16)")
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
                         help="ranks to start (default: 2 on CPU, every local GPU)")
    runtime.add_argument("--mixed-precision", choices=("fp32", "bf16"), default="fp32",
                         help="bf16 gathers parameters and reduces gradients in bfloat16 (default fp32)")
    runtime.add_argument("--eager-init", action="store_true",
                         help="build the whole model on every rank before sharding it (default: build on the "
                              "meta device and materialise only each rank's parts; same values)")
    runtime.add_argument("--compress", choices=COMPRESS_CHOICES, default=None,
                         help="quantise weights / gradients on the wire (default: OVERLAP_COMPRESS, else none)")
    runtime.add_argument("--offload", choices=OFFLOAD_CHOICES, default=None,
                         help="where master shards, gradients and optimizer state live (default: OVERLAP_OFFLOAD, "
                              "else none; docs/offload.md)")
    runtime.add_argument("--compile", action="store_const", const=True, default=None,
                         help="compile each block's compute with torch.compile (default: OVERLAP_COMPILE, else "
                              "eager; docs/compile.md)")
    runtime.add_argument("--prefetch-depth", type=_non_negative_int, default=None,
                         help="units gathered ahead (default: the planner's choice)")
    runtime.add_argument("--bucket-mb", type=_positive_float, default=None,
                         help="merge consecutive units up to this size (default: the planner's choice)")
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


def _read_text(path: Optional[str]) -> tuple[str, bytes]:
    if path is None:
        return DEFAULT_TEXT, resources.files("overlap").joinpath("data").joinpath(DEFAULT_TEXT).read_bytes()
    try:
        with open(path, "rb") as f:
            return os.path.basename(path), f.read()
    except OSError as exc:
        raise ValueError(f"--data {path!r} cannot be read: {exc.strerror}") from None


def _check(args: argparse.Namespace) -> None:
    """Reject settings that cannot work, naming the option."""
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    name, text = _read_text(args.data)
    shortest = int(len(text) * VAL_FRACTION)
    if shortest < args.seq + 1:
        raise ValueError(f"--seq {args.seq} is too long for {name} ({len(text)} bytes; the validation split "
                         f"has {shortest}); use a shorter --seq or a longer text")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir")
    if args.checkpoint_dir is not None:
        try:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} cannot be made: "
                             f"{exc.strerror or exc}") from None
    launching = not dist.is_torchelastic_launched()
    if launching and args.world_size and torch.cuda.is_available() and args.world_size > torch.cuda.device_count():
        raise ValueError(f"--world-size {args.world_size} exceeds the {torch.cuda.device_count()} local GPUs")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        print(f"overlap train: error: {exc}", file=sys.stderr)
        return 2
    if dist.is_torchelastic_launched():
        code = run_rank(args)
        # gloo's threads and the process group's destructor can deadlock or abort during
        # interpreter shutdown; everything is written and flushed, so leave directly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return _launch(args)


def _launch(args: argparse.Namespace) -> int:
    """Start the ranks on this machine through torchrun's launcher API and wait for them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn")
    try:
        results = elastic_launch(config, run_rank)(args)
    except ChildFailedError as exc:
        print(f"overlap train: a rank failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return max(results.values(), default=0)


def _peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocated device memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def _schedule_steps(args: argparse.Namespace) -> int:
    return args.schedule_steps if args.schedule_steps is not None else args.steps


def _learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 10% of the schedule, then cosine decay to a tenth of the
    peak, which it keeps past the schedule's end."""
    steps = _schedule_steps(args)
    warmup = max(1, steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class ByteBatches:
    """Random windows of a byte string, split into train and validation parts.

    The windows of a draw depend only on (seed, rank, split, draw). Training step s takes
    draw s, so a resumed run needs nothing but the step count to go on with the same batches."""

    def __init__(self, text: bytes, seq: int, device: torch.device, seed: int, rank: int = 0) -> None:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - VAL_FRACTION))
        self.splits = {"train": data[:cut], "val": data[cut:]}
        self.seq = seq
        self.device = device
        self.seed = seed
        self.rank = rank
        self.generator = torch.Generator()

    def get(self, split: str, batch: int, draw: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        key = hashlib.blake2b(f"{self.seed}/{self.rank}/{split}/{draw}".encode(), digest_size=8).digest()
        self.generator.manual_seed(int.from_bytes(key, "little"))
        starts = torch.randint(len(data) - self.seq - 1, (batch,), generator=self.generator)
        window = torch.stack([data[s:s + self.seq + 1] for s in starts.tolist()])
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)


def _mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


@torch.no_grad()
def _val_loss(model: torch.nn.Module, batches: ByteBatches, batch: int, device: torch.device) -> float:
    model.eval()
    losses = [model(*batches.get("val", batch, draw)).item() for draw in range(VAL_BATCHES)]
    model.train()
    return _mean_over_ranks([sum(losses) / len(losses)], device)[0]


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """`init_process_group` from torchrun's environment, safe across `--max-restarts`.

    torchrun's c10d rendezvous serves one store to every attempt of the worker group, and what
    a process group writes there at start-up (each rank's address, NCCL's id) outlives it: a
    restarted group would read its predecessor's entries and connect to ranks that are gone.
    Every attempt therefore gets keys of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"overlap/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def _print_compile_seconds(bar: "tqdm", rank: int, world: int) -> None:
    """Once, after the first step (which compiles the blocks): each rank's compile time."""
    seconds = torch._dynamo.utils.calculate_time_spent()["total_wall_time"]
    per_rank: list[Optional[float]] = [None] * world
    dist.all_gather_object(per_rank, seconds)
    if rank == 0:
        bar.write("compiled the blocks in " + ", ".join(f"{s:.1f}" for s in per_rank) + " s (per rank)")


def run_rank(args: argparse.Namespace) -> int:
    """One rank of the job (under torchrun or started by `_launch`)."""
    from tqdm import tqdm

    from overlap import MixedPrecision, ShardedModule
    from overlap.checkpoint import CheckpointMismatch
    from overlap.models import GPT, Block, GPTConfig
    from overlap.base.profiling import phase
    from overlap.observe.report import format_seconds
    from overlap.observe.timeline import TraceRecorder

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(dist.get_node_local_rank())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    _init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.world_size is not None and args.world_size != world:
            if rank == 0:
                print(f"overlap train: error: --world-size {args.world_size} but torchrun started {world} ranks",
                      file=sys.stderr)
            return 2
        if not use_cuda:
            # Ranks share the cores: more threads than cores per rank only adds contention.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

        torch.manual_seed(args.seed)
        config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                           n_embd=args.hidden)
        precision = MixedPrecision(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16" else None
        # On the meta device no rank ever holds the whole model; the values are the same as an
        # eager build's (the GPT initialises in construction order).
        with contextlib.nullcontext() if args.eager_init else torch.device("meta"):
            gpt = GPT(config)
        model = ShardedModule(gpt, unit_types=(Block,), mixed_precision=precision,
                              prefetch_depth=args.prefetch_depth, bucket_mb=args.bucket_mb,
                              compression=args.compress, compile=args.compile, offload=args.offload)
        optimizer = torch.optim.AdamW(model.module.optimizer_groups(model.named_parameters(), args.weight_decay),
                                      lr=args.lr, betas=(0.9, 0.95))
        name, text = _read_text(args.data)
        batches = ByteBatches(text, args.seq, device, seed=args.seed, rank=rank)

        if rank == 0:
            print(f"overlap train: GPT {args.layers} layers, d={args.hidden}, {args.heads} heads, "
                  f"seq {args.seq} ({config.num_params / 1e6:.2f}M params, {args.mixed_precision}) on {world} "
                  f"{'GPUs (nccl)' if use_cuda else 'CPU ranks (gloo)'}; {name}, {len(text) / 1e3:.1f} kB; "
                  f"batch {args.batch}/rank; {len(model.scheduler.units)} units, prefetch depth "
                  f"{model.overlap_config.prefetch_depth}, bucket {model.overlap_config.bucket_mb:.3g} MB", flush=True)

        # The train-loss window of the next `step N:` line (the steps since the last multiple
        # of --eval-every) travels with the checkpoint, so that a resumed run prints the same
        # lines as an uninterrupted one.
        first_step, window = 0, []
        if args.checkpoint_dir is not None:
            try:
                first_step, window = _resume(args, model, optimizer, rank, name)
            except CheckpointMismatch as exc:
                if rank == 0:
                    print(f"overlap train: error: --checkpoint-dir {args.checkpoint_dir}: {exc}", file=sys.stderr)
                return 2
            if first_step > args.steps:
                if rank == 0:
                    print(f"overlap train: error: the newest checkpoint in --checkpoint-dir {args.checkpoint_dir} "
                          f"is at step {first_step}, past --steps {args.steps}", file=sys.stderr)
                return 2
            if first_step == args.steps:
                if rank == 0:
                    print(f"overlap train: all --steps {args.steps} are done; nothing to train")
                return 0

        tracer = None
        if args.trace is not None:
            tracer = TraceRecorder(args.trace, capture_step=min(2, args.steps - first_step - 1), device=device)
            model.step_end.controllers.append(tracer)
        saver = _Saver(args, model, optimizer, name) if args.checkpoint_dir is not None else None

        bar = tqdm(range(first_step, args.steps), initial=first_step, total=args.steps, disable=rank != 0,
                   dynamic_ncols=True, desc="train")
        hidden = 0.0
        for step in bar:
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, args)
            inputs, targets = batches.get("train", args.batch, step)
            with phase("overlap::forward"):
                loss = model(inputs, targets)
            with phase("overlap::backward"):
                loss.backward()
            with phase("overlap::optimizer_step"):
                model.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if tracer is not None:
                tracer.step()
            mean_loss, peak_memory = _mean_over_ranks([loss.item(), _peak_memory_bytes(device)], device)
            if step == first_step and model.overlap_config.compile:
                _print_compile_seconds(bar, rank, world)
            window.append(mean_loss)
            elapsed = time.perf_counter() - started
            if step % HIDDEN_EVERY == 1:       # the analysis behind it costs host time: not every step
                last = model.overlap_monitor.last
                hidden = 100 * last.hidden_fraction if last is not None else 0.0
            bar.set_postfix_str(f"loss {mean_loss:.3f}, step {format_seconds(elapsed)}, {hidden:.0f}% comm hidden, "
                                f"mem {peak_memory / 2**20:.0f} MB/rank", refresh=False)
            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                val = _val_loss(model, batches, args.batch, device)
                if rank == 0:   # tqdm.write prints even where the bar is disabled
                    bar.write(f"step {done}: train loss {sum(window) / len(window):.3f}, val loss {val:.3f}")
                if done % args.eval_every == 0:     # a last step between multiples keeps its window
                    window = []
            if saver is not None and (done == args.steps or done % (args.checkpoint_every or args.steps) == 0):
                saver.save(done, window)
        bar.close()
        if saver is not None:
            saver.wait()

        trace_png = tracer.finish() if tracer is not None else None
        if rank == 0:
            print(f"final step {args.steps}: loss {mean_loss:.8f} (the last step's, mean over ranks), "
                  f"val loss {val:.8f}")
            print(model.overlap_report().to_text())
            if saver is not None:
                print(saver.summary())
            if trace_png is not None:
                print(f"trace: {args.trace}/trace_rank<r>.json (one per rank), timeline {trace_png}")
        if args.sample:
            _print_samples(model, args, device, rank)
        return 0
    finally:
        dist.destroy_process_group()


def _settings(args: argparse.Namespace, text_name: str) -> dict:
    """The options that shape the run beyond the model's size (load checks that), saved with
    each checkpoint so that a resume with other values is pointed out."""
    return {"--seed": args.seed, "--batch": args.batch, "--lr": args.lr, "--weight-decay": args.weight_decay,
            "--schedule-steps (default: --steps)": _schedule_steps(args), "--mixed-precision": args.mixed_precision,
            "--data": text_name}


def _resume(args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
            text_name: str) -> tuple[int, list[float]]:
    """Load the newest complete checkpoint in --checkpoint-dir (rank 0 chooses, every rank
    loads the same one); returns the completed steps and the open train-loss window."""
    from overlap import checkpoint
    from overlap.checkpoint import CheckpointMismatch

    choice = [checkpoint.latest_checkpoint(args.checkpoint_dir) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    path = choice[0]
    if path is None:
        return 0, []
    extra = checkpoint.load(path, model, optimizer)
    if "step" not in extra or "window" not in extra:
        raise CheckpointMismatch(f"checkpoint {path} holds no step count: it was not saved by overlap train")
    step = int(extra["step"])
    if rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
        saved = extra.get("settings", {})
        for option, value in _settings(args, text_name).items():
            if option in saved and saved[option] != value:
                print(f"overlap train: note: {option} is {value}, it was {saved[option]} when {path} was saved")
    return step, [float(x) for x in extra["window"]]


class _Saver:
    """Asynchronous saves into --checkpoint-dir, and how long each held training up."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 text_name: str) -> None:
        self.directory = args.checkpoint_dir
        self.model = model
        self.optimizer = optimizer
        self.settings = _settings(args, text_name)
        self.pending = None
        self.blocking: list[float] = []
        self.last_wait = 0.0

    def save(self, step: int, window: list[float]) -> None:
        from overlap import checkpoint

        started = time.perf_counter()
        # Returns once the state is staged in host memory (after the previous save finished).
        self.pending = checkpoint.async_save(os.path.join(self.directory, f"step-{step:08d}"), self.model,
                                             self.optimizer,
                                             extra={"step": step, "window": list(window), "settings": self.settings})
        self.blocking.append(time.perf_counter() - started)

    def wait(self) -> None:
        if self.pending is not None:
            started = time.perf_counter()
            self.pending.wait()
            self.last_wait = time.perf_counter() - started

    def summary(self) -> str:
        from overlap.observe.report import format_seconds

        saves = f"{len(self.blocking)} save{'s' if len(self.blocking) > 1 else ''}"
        return (f"checkpoints: {saves}, {format_seconds(statistics.median(self.blocking))} blocking each "
                f"(median; longest {format_seconds(max(self.blocking))}), {format_seconds(self.last_wait)} "
                f"waiting for the last one at the end; newest {self.pending.path}")


def _print_samples(model: torch.nn.Module, args: argparse.Namespace, device: torch.device, rank: int) -> None:
    """Generate through the ShardedModule (every rank takes part in the gathers)."""
    torch.manual_seed(args.seed)            # the same draws on every rank
    model.eval()
    prompt = torch.full((args.sample, 1), ord("\n"), dtype=torch.long, device=device)
    out = model.generate(prompt, max_new_tokens=args.sample_len)
    if rank == 0:
        for index, row in enumerate(out[:, 1:].tolist()):
            print(f"--- sample {index + 1} ---\n{bytes(row).decode('utf-8', errors='replace')}")
