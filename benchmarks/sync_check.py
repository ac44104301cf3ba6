"""Host synchronisations in the steady-state training step.

    python benchmarks/sync_check.py [--steps 4] [--compression int8]

On CUDA: a small model wrapped in ShardedModule trains a few warm-up steps, then a few more
under `torch.cuda.set_sync_debug_mode("error")` (any copy to the host, `.item()`,
`.tolist()` of a device tensor or stream/device synchronisation raises) and with the calls
that block the host without going through that mode counted (`Event.synchronize`,
`Stream.synchronize`, `torch.cuda.synchronize`; `Event.elapsed_time`, which is allowed on
events that have completed, is counted for information). Prints PASS with the counts, or
FAIL and exits 1. Without CUDA it prints SKIP.

One process: a machine with one GPU cannot run two NCCL ranks, so the flags all-reduce and
hybrid sharding's all-reduce (which need two ranks) are covered on CPU by
tests/test_host_syncs.py and tests/test_all_reduce_stream.py, not here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.distributed as dist

import overlap
import overlap.kernels
from common import single_rank_env

# Where the package's own code lives (overlap.kernels is installed from kernels/): a call is
# counted when a frame there made it.
_PACKAGE_DIRS = (os.path.dirname(overlap.__file__) + os.sep, list(overlap.kernels.__path__)[0] + os.sep)
# (owner, method): each blocks the host until the device catches up when its tensor or
# event is on the device.
SYNC_CALLS: list[tuple[object, str]] = [
    (torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "cpu"),
    (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "elapsed_time"),
    (torch.cuda.Stream, "synchronize"),
]


def _moves_to_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to` call names a device (a copy between host and device), not only a dtype."""
    return any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs


@contextlib.contextmanager
def count_sync_calls() -> Iterator[Counter]:
    """Count, by "owner.method in file:function" (the caller in overlap), the calls of SYNC_CALLS (and `Tensor.to` with a device) that
    overlap's own code makes inside the block. On CPU the same Python runs, so the counts
    say which of those calls the steady-state step makes; whether each would synchronise
    depends on its tensor being on the device, which a CPU run cannot show."""
    counts: Counter = Counter()
    originals: list[tuple[object, str, Callable]] = []

    def wrap(owner: object, name: str, original: Callable, only: Callable[[tuple, dict], bool]) -> Callable:
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(_PACKAGE_DIRS) and only(args[1:], kwargs):
                counts[f"{label} in {os.path.basename(caller.co_filename)}:{caller.co_name}"] += 1
            return original(*args, **kwargs)

        return counted

    for owner, name in SYNC_CALLS + [(torch.Tensor, "to")]:
        original = getattr(owner, name)
        only = _moves_to_a_device if name == "to" else (lambda args, kwargs: True)
        originals.append((owner, name, original))
        setattr(owner, name, wrap(owner, name, original, only))
    try:
        yield counts
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)],
                               torch.nn.Linear(256, 8))


def _init_one_process() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(single_rank_env())
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steady-state steps checked")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compression", default=None, help="none, int8 or int8-int4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: sync_check needs a CUDA device")
        return 0
    from overlap import ShardedModule

    _init_one_process()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = ShardedModule(_model().to(device), bucket_mb=0.1, compression=args.compression)
    # SGD without momentum: an optimizer that itself never synchronises.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(32, 256, device=device)

    def step() -> torch.Tensor:
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    failure = None
    with count_sync_calls() as counts:
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses = [step() for _ in range(args.steps)]
        except RuntimeError as exc:
            failure = f"a synchronising call in the steady-state step: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    blocking = {k: v for k, v in counts.items() if not k.startswith("Event.elapsed_time")}
    if failure is None and blocking:
        failure = f"blocking calls from overlap: {dict(blocking)}"
    if failure is None and not all(torch.isfinite(loss).item() for loss in losses):
        failure = "a non-finite loss"
    dist.destroy_process_group()
    if failure is not None:
        print(f"FAIL: {failure}")
        return 1
    print(f"PASS: {args.steps} steady-state steps, no synchronising call; overlap's calls: {dict(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
