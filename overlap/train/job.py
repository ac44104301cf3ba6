"""`overlap train`: train a small byte-level GPT with ShardedModule on a text shipped in the
package and report how much of the communication was hidden.

Run on its own it starts its ranks itself through torchrun's launcher API (2 gloo ranks on
CPU, one nccl rank per local GPU); launched by torchrun it runs as one of torchrun's ranks.

With --checkpoint-dir it saves sharded checkpoints there in the background and, started
again (by hand, by `torchrun --max-restarts`, or by torchrun's elastic `--nnodes MIN:MAX` at
another world size), resumes from the newest complete one with the same global batches,
learning rates and losses as a run that was never interrupted.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import uuid
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from overlap.train.options import build_parser, check_options, check_world_size


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    try:
        check_options(args)
    except ValueError as exc:
        print(f"overlap train: error: {exc}", file=sys.stderr)
        return 2
    if dist.is_torchelastic_launched():
        from overlap.train.rank import run_rank

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
    try:
        check_world_size(args, world)
    except ValueError as exc:
        print(f"overlap train: error: {exc}", file=sys.stderr)
        return 2
    # [Note: ranks forked from a fork server]
    # A spawned rank is a fresh interpreter that imports torch and this package again (about
    # 2.5 s of CPU each on a 2-core machine, paid by every rank of every launch). The ranks
    # are forked instead from one fork server that imported them once. The server imports
    # modules only: no process group, no threads, no CUDA context (torch initialises CUDA
    # lazily), so forking from it is safe; this process, which holds the rendezvous store's
    # thread, is never forked. torch._dynamo is imported by every rank anyway (torch.optim's
    # optimizers import it when built; 0.5 s with what it pulls in), so the server imports it too.
    multiprocessing.set_forkserver_preload(["overlap.train.rank", "torch._dynamo"])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          start_method="forkserver")
    try:
        results = elastic_launch(config, _run_rank)(args)
    except ChildFailedError as exc:
        print(f"overlap train: a rank failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return max(results.values(), default=0)


def _run_rank(args: argparse.Namespace) -> int:
    """One rank's run, imported in the rank (the fork server has it loaded already), so that
    the launching process never imports the runtime it does not use."""
    from overlap.train.rank import run_rank

    return run_rank(args)
