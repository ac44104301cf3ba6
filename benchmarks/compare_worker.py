"""The program each launch of compare.py runs (`compare.py --worker IMPL`): one implementation
trains the model, then rank 0 writes every rank's step times, phases, losses, memory and, for
ShardedModule, its records of the collectives. overlap and torch.distributed are imported where
used: the driver does without them.
"""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

import peers
from common import from_every_rank, peak_rss, start_rank, write_json
from gpt_options import model_config, token_batch

if TYPE_CHECKING:
    from overlap.models import GPTConfig


def _overlap_step_comm(model) -> dict[str, Any]:
    """This step's collectives and prefetch outcome, from ShardedModule's record of it."""
    record = model.scheduler.last_step
    kinds = sorted({c.kind for c in record.collectives})
    marks = [e.mark.value for e in record.events]
    return {
        "bytes": sum(c.nbytes for c in record.collectives),
        "bytes_by_kind": {k: sum(c.nbytes for c in record.collectives if c.kind == k) for k in kinds},
        "exposed_s_by_kind": {k: sum(c.waited for c in record.collectives if c.kind == k) for k in kinds},
        "duration_s_by_kind": {k: sum(c.duration for c in record.collectives if c.kind == k) for k in kinds},
        "prefetch_hits": marks.count("hit"),
        "prefetch_misses": marks.count("miss"),
    }


def _overlap_trace(model) -> dict[str, list]:
    """One step's marks and collectives, times in ms from the step's start."""
    record = model.scheduler.last_step
    record = record.shifted(record.bounds()[0])

    def ms(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t * 1e3, 2)

    return {
        "events": [(e.mark.value, e.unit, ms(e.time)) for e in record.events],
        "collectives": [dict(kind=c.kind, unit=c.unit, nbytes=c.nbytes, start=ms(c.start), end=ms(c.end),
                             wait_start=ms(c.wait[0] if c.wait else None), wait_end=ms(c.wait[1] if c.wait else None))
                        for c in record.collectives],
    }


def _build_model(args: argparse.Namespace, config: "GPTConfig") -> torch.nn.Module:
    """The GPT, or (`--model mlp`) narrow_mlp.NarrowMLP."""
    if args.model == "mlp":
        from narrow_mlp import NarrowMLP

        return NarrowMLP(config.n_layer, config.n_embd, config.vocab_size)
    from overlap.models import GPT

    return GPT(config)


def run_worker(args: argparse.Namespace) -> None:
    impl = args.worker
    torch.set_num_threads(1)
    distributed = impl not in peers.SINGLE_PROCESS
    rank, world = start_rank() if distributed else (0, 1)

    config = model_config(args)
    torch.manual_seed(args.seed)
    plain = _build_model(args, config)
    params = sum(p.numel() for p in plain.parameters())
    root_params = params - sum(p.numel() for p in plain.blocks.parameters())
    block_params = sum(p.numel() for p in plain.blocks[-1].parameters())
    model, optimizer, train_step = peers.wrap(impl, plain, args)
    total_steps = args.warmup + args.steps
    batches = [token_batch(args, rank, step) for step in range(total_steps + 1)]

    step_s, phase_s, losses, comm, trace = [], [], [], [], None
    first_step_s = None                      # compiled rows compile in it
    for step in range(total_steps):
        start = time.perf_counter()
        loss, phases = train_step(batches[step])
        elapsed = time.perf_counter() - start
        losses.append(loss)
        first_step_s = elapsed if first_step_s is None else first_step_s
        if step < args.warmup:
            continue
        step_s.append(elapsed)
        phase_s.append(phases)
        if impl in peers.SHARDED_MODULE:
            comm.append(_overlap_step_comm(model))
            trace = _overlap_trace(model)
    memory = peers.tracked_memory(model, optimizer, lambda: train_step(batches[total_steps]),
                                  flat_buffers=impl == peers.OVERLAP) if args.memory else None
    mine = dict(step_s=step_s, phase_s=phase_s, loss=losses, memory=memory, peak_rss=peak_rss(), comm=comm,
                trace=trace, first_step_s=first_step_s)
    ranks = from_every_rank(mine) if distributed else [mine]
    if rank == 0:
        settings = {}
        if impl in peers.SHARDED_MODULE:
            from overlap.control.compression_auto import CompressionChooser

            codec = model.collectives.codec
            chooser = [c for c in model.step_end.controllers if isinstance(c, CompressionChooser)]
            settings = dict(prefetch_depth=model.overlap_config.prefetch_depth, bucket_mb=model.overlap_config.bucket_mb,
                            units=len(model.scheduler.units),
                            compression="none" if codec is None else codec.settings.mode,
                            compression_reason=chooser[0].reason if chooser else None)
        write_json(args.result, dict(impl=impl, world_size=world, params=params, root_params=root_params,
                                     block_params=block_params, settings=settings, ranks=ranks,
                                     optimizer=peers.optimizer_kwargs()))
