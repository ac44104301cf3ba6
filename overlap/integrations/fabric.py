"""`OverlapFabricStrategy`: Lightning Fabric (`Fabric(strategy=OverlapFabricStrategy(...))`, or
`strategy="overlap"` once this module is imported) with the model in `ShardedModule`.

    model = fabric.setup_module(model)                   # wraps it; build the optimizer after
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    with fabric.no_backward_sync(model, enabled=accumulating): ...   # ShardedModule.no_sync
    fabric.clip_gradients(model, optimizer, max_norm=1.0)             # over every rank's parts
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # a directory
    fabric.load(path, {"model": model, "optimizer": optimizer})                 # any world size

`fabric.init_module(empty_init=True)` builds on the meta device; wrapping materialises it unit
by unit. Wrapping replaces the parameters by this rank's parts, so the optimizer is built from
the wrapped model (`fabric.setup(model, optimizer)` with an optimizer made before is refused).
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import (_distributed_is_initialized,
                                                    _get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.fabric.wrappers import _unwrap_objects
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from overlap.base.mixed_precision import MixedPrecision
from overlap.integrations.framework_checkpoint import load_checkpoint, save_checkpoint
from overlap.integrations.options import ShardingOptions
from overlap.sharded_module import ShardedModule

__all__ = ["OverlapFabricStrategy"]

# The key of the values saved beside the model and optimizer (`fabric.save`'s other entries).
FABRIC_STATE = "fabric"


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, ShardedModule):
            raise TypeError(f"no_backward_sync needs the model set up by OverlapFabricStrategy, got {type(module).__name__}")
        return module.no_sync()


class OverlapFabricStrategy(ParallelStrategy):
    """Train with `ShardedModule` under Lightning Fabric. The sharding arguments are
    `ShardedModule`'s; `mixed_precision` None follows Fabric's `precision` ("bf16-mixed":
    gather in bf16, reduce in fp32). `process_group`: shard over these ranks and run Fabric's
    collectives on them (default the world)."""

    strategy_name = "overlap"

    def __init__(self, *, unit_types: Optional[Sequence[type]] = None, sharding: Optional[str] = None,
                 compression: Optional[str] = None, mixed_precision: Optional[MixedPrecision] = None,
                 prefetch_depth: Optional[int] = None, bucket_mb: Optional[float] = None,
                 reshard_after_forward: bool = True, param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 accelerator: Optional[Accelerator] = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        self.options = ShardingOptions(
            unit_types=unit_types, sharding=sharding, compression=compression, mixed_precision=mixed_precision,
            prefetch_depth=prefetch_depth, bucket_mb=bucket_mb, reshard_after_forward=reshard_after_forward,
            param_init_fn=param_init_fn, process_group=process_group)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._backward_sync_control = _NoSync()
        self._num_nodes = 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    # ---- the model ----------------------------------------------------------------------------

    def module_init_context(self, empty_init: Optional[bool] = None) -> ContextManager:
        """`empty_init=True` builds on the meta device (`ShardedModule` materialises it)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list, Optional[Any]]:
        if optimizers:
            raise ValueError("OverlapFabricStrategy: wrapping replaces the parameters by this rank's parts, so an "
                             "optimizer made before holds the wrong tensors: call `model = fabric.setup_module(model)`, "
                             "build the optimizer from `model.parameters()`, then `fabric.setup_optimizers(optimizer)`")
        return self.setup_module(module), [], scheduler

    def setup_module(self, module: nn.Module) -> ShardedModule:
        if isinstance(module, ShardedModule):
            return module
        return self.options.wrap(module, self.precision.precision)

    def module_to_device(self, module: nn.Module) -> None:
        # Before wrapping (Fabric moves the plain module first); a meta-device module stays
        # where it is and is materialised by wrapping. After wrapping the shards are in place.
        if isinstance(module, ShardedModule):
            return
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module.to(self.root_device)

    def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        if not isinstance(module, ShardedModule):
            raise TypeError(f"clip_gradients needs the model set up by OverlapFabricStrategy, got {type(module).__name__}")
        self.precision.unscale_gradients(optimizer)
        total = module.clip_grad_norm_(float(max_norm), norm_type=float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})")
        return total

    def full_state_dict(self, module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (CPU tensors) for inference, on rank 0 alone unless
        `rank0_only=False`; called on every rank with the model `setup_module` returned."""
        sharded = _unwrap_objects(module)
        if not isinstance(sharded, ShardedModule):
            raise TypeError(f"full_state_dict needs the model set up by OverlapFabricStrategy, got {type(sharded).__name__}")
        return sharded.full_state_dict(rank0_only=rank0_only)

    # ---- collectives on the sharding group ----------------------------------------------------

    def all_reduce(self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[torch.Tensor, Any]:
        if isinstance(tensor, torch.Tensor):
            group = group if group is not None else self.options.process_group
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self.options.process_group)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        group = self.options.process_group
        dist.broadcast_object_list(box, src if group is None else dist.get_global_rank(group, src), group=group)
        return box[0]

    # ---- checkpoints --------------------------------------------------------------------------

    @staticmethod
    def _split(state: dict[str, Any]) -> tuple[str, ShardedModule, Optional[str], Optional[torch.optim.Optimizer],
                                                dict[str, Any]]:
        """(model key, model, optimizer key, optimizer, everything else) of a `fabric.save` state."""
        models = [(k, v) for k, v in state.items() if isinstance(v, ShardedModule)]
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) > 1:
            raise ValueError("OverlapFabricStrategy checkpoints hold one model set up by this strategy and at most "
                             f"one optimizer; got models {[k for k, _ in models]}, optimizers {[k for k, _ in optimizers]}")
        model_key, model = models[0]
        optimizer_key, optimizer = optimizers[0] if optimizers else (None, None)
        rest = {k: v for k, v in state.items() if k not in (model_key, optimizer_key)}
        return model_key, model, optimizer_key, optimizer, rest

    def save_checkpoint(self, path: Union[str, os.PathLike], state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Every rank: the model and optimizer sharded into the directory `path` (no gather),
        the other entries beside them (plain values and tensors, or objects with a state_dict)."""
        if storage_options is not None or filter is not None:
            raise TypeError("OverlapFabricStrategy.save_checkpoint: storage_options and filter are not supported")
        path = self.broadcast(os.fspath(path))
        _, model, _, optimizer, rest = self._split(state)
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        save_checkpoint(path, model, optimizer, rest, FABRIC_STATE)

    def load_checkpoint(self, path: Union[str, os.PathLike], state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the model and optimizer of `state` in place (at any world size), restore its
        other entries (in place where they have `load_state_dict`); return the saved entries
        `state` did not ask for."""
        if not isinstance(state, dict) or not state:
            raise ValueError("OverlapFabricStrategy.load_checkpoint needs the state to load into: "
                             "{'model': model, 'optimizer': optimizer, ...}")
        path = self.broadcast(os.fspath(path))
        _, model, _, optimizer, rest = self._split(state)
        saved = load_checkpoint(path, model, optimizer, FABRIC_STATE)
        missing = [key for key in rest if key not in saved]
        if strict and missing:
            raise KeyError(f"checkpoint {path} holds no {missing}")
        for key, target in rest.items():
            if key not in saved:
                continue
            value = saved.pop(key)
            if hasattr(target, "load_state_dict") and not isinstance(target, dict):
                target.load_state_dict(value)
            else:
                state[key] = value
        return saved

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="ZeRO-3 sharding by overlap.ShardedModule")


OverlapFabricStrategy.register_strategies(STRATEGY_REGISTRY)
