"""How compare.py builds and steps each implementation: ShardedModule, FSDP2 and DDP as their
defaults give them and tuned for a 2-rank gloo job on CPU, DeepSpeed ZeRO-3, and the single
process. All get the same optimizer implementation (`make_optimizer`), so that step times
differ by sharding and communication alone.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Iterable, Optional

import torch

OVERLAP = "overlap"
FSDP2 = "fsdp2"
FSDP2_TUNED = "fsdp2-tuned"
DDP = "ddp"
DDP_TUNED = "ddp-tuned"
DEEPSPEED = "deepspeed"
LOCAL = "local"
IMPLEMENTATIONS = (OVERLAP, FSDP2, FSDP2_TUNED, DDP, DDP_TUNED, DEEPSPEED, LOCAL)
# Compressed communication (docs/compression.md), run when --impls names them.
OVERLAP_INT8 = "overlap-int8"
OVERLAP_INT8_INT4 = "overlap-int8-int4"
OVERLAP_AUTO = "overlap-auto"           # the planner decides after the first measured step
DDP_FP16 = "ddp-fp16"
COMPRESSED = (OVERLAP_INT8, OVERLAP_INT8_INT4, OVERLAP_AUTO, DDP_FP16)
# Compiled compute (docs/compile.md): ShardedModule(compile=True), the others with each block
# compiled before wrapping (torchtitan's recipe); each paired with its eager twin.
OVERLAP_COMPILED = "overlap-compiled"
FSDP2_TUNED_COMPILED = "fsdp2-tuned-compiled"
DDP_TUNED_COMPILED = "ddp-tuned-compiled"
LOCAL_COMPILED = "local-compiled"
EAGER_TWIN = {OVERLAP_COMPILED: OVERLAP, FSDP2_TUNED_COMPILED: FSDP2_TUNED, DDP_TUNED_COMPILED: DDP_TUNED,
              LOCAL_COMPILED: LOCAL}
COMPILED = tuple(EAGER_TWIN)
ALL = IMPLEMENTATIONS + COMPRESSED + COMPILED
SHARDED_MODULE = {OVERLAP: "none", OVERLAP_INT8: "int8", OVERLAP_INT8_INT4: "int8-int4", OVERLAP_AUTO: "auto",
                  OVERLAP_COMPILED: "none"}
SINGLE_PROCESS = (LOCAL, LOCAL_COMPILED)


def unavailable() -> dict[str, str]:
    """Implementations that cannot run here, with the reason (DeepSpeed is not a dependency)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return {DEEPSPEED: "DeepSpeed is not installed; `pip install deepspeed` adds it"}
    return {}


def optimizer_kwargs() -> dict[str, Any]:
    """AdamW's fused kernel where this torch has it for CPU tensors, else foreach."""
    probe = torch.nn.Parameter(torch.zeros(1))
    probe.grad = torch.zeros(1)
    try:
        torch.optim.AdamW([probe], fused=True).step()
        return dict(fused=True)
    except (RuntimeError, TypeError):
        return dict(foreach=True)


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, **optimizer_kwargs())


# FSDP2 tuned for a CPU (gloo) job (docs/benchmarks.md): async unshard (FSDP2's side streams do
# nothing on CPU, so each all-gather would block), explicit prefetch lists, the reduce-scatter by
# all-to-all and a local sum (gloo emulates `reduce_scatter_single` slowly), and the last block
# kept gathered after forward; its stream-memory and NCCL knobs have nothing to gain on CPU.


class AllToAllReduceScatter:
    """FSDP2's ReduceScatter over gloo's all-to-all plus a local sum (the first and last rank read
    their own chunk in place: every rank receives (N-1)/N of the input, as in a ring)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        import torch.distributed as dist

        world, rank = group.size(), group.rank()
        shard = output_tensor.numel()
        keeps_own = rank in (0, world - 1)
        sizes = [0 if r == rank and keeps_own else shard for r in range(world)]
        received = torch.empty(sum(sizes), dtype=input_tensor.dtype, device=input_tensor.device)
        send = input_tensor.narrow(0, shard if rank == 0 else 0, sum(sizes)) if keeps_own else input_tensor
        dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=sizes, group=group)
        chunks = received.view(-1, shard)
        if keeps_own:
            output_tensor.copy_(input_tensor.narrow(0, rank * shard, shard))
        else:
            output_tensor.zero_()
        for chunk in chunks:
            output_tensor.add_(chunk)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter supports SUM and AVG, not {op}")
        return None


def reduce_scatter_by_all_to_all(*modules: Any) -> None:
    """FSDP2's `modules` reduce-scatter through `AllToAllReduceScatter`."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    comm = type("AllToAllReduceScatterComm", (AllToAllReduceScatter, ReduceScatter), {})()
    for module in modules:
        module.set_custom_reduce_scatter(comm)


def shard_by_block(fully_shard: Callable[..., Any], model: torch.nn.Module,
                   blocks: Optional[Iterable[torch.nn.Module]] = None, **kwargs: Any) -> torch.nn.Module:
    """`fully_shard` (FSDP2's or overlap's) with `kwargs` on each block (default `model.blocks`), then the root."""
    for block in model.blocks if blocks is None else blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def fsdp2(model: torch.nn.Module, tuned: bool, depth: int, mesh=None) -> torch.nn.Module:
    """FSDP2 on each of `model.blocks`, then the root: defaults, or tuned (prefetch lists of `depth`
    blocks). A 2-D (replicate, shard) `mesh` makes it HSDP, tuned the same way."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if mesh is None else mesh
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=not (tuned and i == len(blocks) - 1))
    root = fully_shard(model, mesh=mesh)
    if not tuned:
        return root
    root._set_unshard_async_op(True)
    reduce_scatter_by_all_to_all(root, *blocks)
    root.set_modules_to_forward_prefetch(blocks[:depth])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])
    return root


def deepspeed_zero3_config(batch: int, block_params: int, persistence_threshold: int) -> dict:
    """ZeRO-3 for CPU ranks: buckets and prefetch of a block's elements; parameters below
    `persistence_threshold` elements stay whole on every rank."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": block_params,
            "stage3_prefetch_bucket_size": block_params,
            "stage3_param_persistence_threshold": persistence_threshold,
        },
    }


def ddp(model: torch.nn.Module, impl: str, bucket_mb: float) -> torch.nn.Module:
    """DDP with its defaults, tuned (gradients as bucket views, `bucket_mb` buckets), or tuned with
    fp16 compression of the all-reduces (DDP_FP16)."""
    from torch.nn.parallel import DistributedDataParallel

    tuned = dict(gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb) if impl != DDP else {}
    wrapped = DistributedDataParallel(model, **tuned)
    if impl == DDP_FP16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        wrapped.register_comm_hook(None, fp16_compress_hook)
    return wrapped


def tracked_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], object],
                   flat_buffers: bool) -> dict[str, dict]:
    """One call of `step` under MemTracker: each category's bytes at the peak, and the peak total
    within forward and within backward. With `flat_buffers` ShardedModule's gathered buffers
    (not nn.Parameters) show as 'Other'."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from overlap.observe.memory import gathered_buffers_as_other

    tracker = MemTracker()
    # DeepSpeed's ZeRO optimizer is a wrapper; the torch optimizer inside holds the state.
    tracker.track_external(model, getattr(optimizer, "optimizer", optimizer))
    with tracker, gathered_buffers_as_other(tracker, model) if flat_buffers else contextlib.nullcontext():
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    snapshots = tracker.memory_tracking[model].snapshots
    phases = {phase: max(next(iter(snap.values()))["Total"] for snap in snapshots[state])
              for phase, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW))}
    return dict(peak={str(getattr(key, "value", key)): int(value) for key, value in peak.items()}, phases=phases)


def wrap(impl: str, model: torch.nn.Module, args: argparse.Namespace):
    """(model to call, optimizer, step function) for `impl`."""
    if impl in COMPILED and impl != OVERLAP_COMPILED:
        for block in model.blocks:
            block.compile()
        impl = EAGER_TWIN[impl]
    if impl == DEEPSPEED:
        import deepspeed

        optimizer = make_optimizer(model.parameters(), args.lr)
        # A GPT block holds 12·d² parameters; vectors up to 4·d (norms, biases) stay whole.
        config = deepspeed_zero3_config(args.batch, 12 * args.n_embd * args.n_embd, args.n_embd * 4)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, optimizer, _timed(engine, engine.backward, engine.step)
    if impl == LOCAL:
        wrapped = model
    elif impl in (DDP, DDP_TUNED, DDP_FP16):
        wrapped = ddp(model, impl, args.ddp_bucket_mb)
    elif impl in (FSDP2, FSDP2_TUNED):
        wrapped = fsdp2(model, impl == FSDP2_TUNED, args.fsdp2_prefetch)
    else:
        from overlap import ShardedModule

        wrapped = ShardedModule(model, unit_types=(type(model.blocks[0]),), prefetch_depth=args.prefetch_depth,
                                bucket_mb=args.bucket_mb, compression=SHARDED_MODULE[impl],
                                compile=impl == OVERLAP_COMPILED)
    optimizer = make_optimizer(wrapped.parameters(), args.lr)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return wrapped, optimizer, _timed(wrapped, lambda loss: loss.backward(), update)


StepFn = Callable[[Any], tuple[float, list[float]]]


def _timed(forward, backward, update) -> StepFn:
    import time

    def step(batch) -> tuple[float, list[float]]:
        """One step; returns the loss and the seconds in forward, backward and the optimizer."""
        idx, targets = batch
        start = time.perf_counter()
        loss = forward(idx, targets)
        forward_end = time.perf_counter()
        backward(loss)
        backward_end = time.perf_counter()
        update()
        end = time.perf_counter()
        return loss.item(), [forward_end - start, backward_end - forward_end, end - backward_end]

    return step
