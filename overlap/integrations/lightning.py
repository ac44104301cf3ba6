"""`OverlapStrategy`: Lightning's `Trainer(strategy=OverlapStrategy(...))` (or `strategy="overlap"`
once this module is imported) trains the LightningModule wrapped in `ShardedModule`.

What Lightning does, and what the strategy does in its place:
- the model: `setup` wraps the LightningModule (after `configure_model`, which runs on the meta
  device, so a large model is materialised unit by unit by `ShardedModule`), then builds the
  optimizers from `configure_optimizers`, whose parameters are then this rank's parts;
- `accumulate_grad_batches`: the batches that only accumulate run under `ShardedModule.no_sync`;
- `gradient_clip_val` (norm): `ShardedModule.clip_grad_norm_`, over every rank's parts;
- `trainer.save_checkpoint(path)` writes a directory through `overlap.checkpoint` (each rank its
  parts, the trainer's own state beside them); `trainer.fit(ckpt_path=path)` resumes from it at
  any world size; `strategy.full_state_dict()` gathers the weights for inference.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (_distributed_is_initialized,
                                                    _get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from overlap.base.mixed_precision import MixedPrecision
from overlap.integrations.framework_checkpoint import load_checkpoint, save_checkpoint
from overlap.integrations.options import ShardingOptions, mixed_precision_for
from overlap.sharded_module import ShardedModule

__all__ = ["OverlapStrategy"]

# The key of the trainer's own state (loops, callbacks, schedulers) inside the checkpoint.
TRAINER_STATE = "lightning"


class _ShardedNormClipping:
    """Mixed into the precision plugin Lightning built for the run, which keeps its autocast
    and dtype handling: only clipping by norm changes, to `ShardedModule.clip_grad_norm_`,
    which gives the same norm as `torch.nn.utils.clip_grad_norm_` in one all-reduce for the
    whole model rather than one per dtype and device."""

    sharded_module: Optional[ShardedModule] = None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        if self.sharded_module is None:
            raise RuntimeError("overlap: gradient clipping before OverlapStrategy.setup wrapped the model")
        self.sharded_module.clip_grad_norm_(float(clip_val))


_CLIPPING_CLASSES: dict[type, type] = {}


def _with_sharded_clipping(plugin: Precision) -> Precision:
    if isinstance(plugin, _ShardedNormClipping):
        return plugin
    base = type(plugin)
    if base not in _CLIPPING_CLASSES:
        _CLIPPING_CLASSES[base] = type(f"Overlap{base.__name__}", (_ShardedNormClipping, base), {})
    clipping = object.__new__(_CLIPPING_CLASSES[base])
    clipping.__dict__.update(plugin.__dict__)
    return clipping


class OverlapStrategy(ParallelStrategy):
    """Train with `ShardedModule` under `lightning.pytorch.Trainer`.

    The sharding arguments are `ShardedModule`'s (see its docstring); `mixed_precision` None
    follows the Trainer's `precision`: "bf16-mixed" gathers in bf16 and reduces in fp32,
    "*-true" shards the module in that dtype. `process_group`: shard over these ranks (and run
    the strategy's reduce, barrier and broadcast on them); default the world.
    """

    strategy_name = "overlap"

    def __init__(self, *, unit_types: Optional[Sequence[type]] = None, sharding: Optional[str] = None,
                 compression: Optional[str] = None, mixed_precision: Optional[MixedPrecision] = None,
                 prefetch_depth: Optional[int] = None, bucket_mb: Optional[float] = None,
                 reshard_after_forward: bool = True, param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 accelerator: Optional[Accelerator] = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout) -> None:
        # Before the base class: its constructor sets the precision plugin, which checks them.
        self.options = ShardingOptions(
            unit_types=unit_types, sharding=sharding, compression=compression, mixed_precision=mixed_precision,
            prefetch_depth=prefetch_depth, bucket_mb=bucket_mb, reshard_after_forward=reshard_after_forward,
            param_init_fn=param_init_fn, process_group=process_group)
        self._sharded_module: Optional[ShardedModule] = None
        self._fitting = False
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1

    # ---- where it runs ------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning for strategies it does not know: each rank gets its own batches.
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            # Kept: setup hands the wrapped model to this same object for clipping.
            self._precision_plugin = _with_sharded_clipping(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None:
            if self.options.mixed_precision is None:
                mixed_precision_for(plugin.precision)       # refuse "16-mixed" before anything runs
            plugin = _with_sharded_clipping(plugin)
        self._precision_plugin = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ---- the model ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """`configure_model` builds on the meta device; `ShardedModule` materialises each unit
        (`param_init_fn`, else the modules' `reset_parameters`) with rank 0's values."""
        with torch.device("meta"):
            yield

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = self._sharded(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # After wrapping: `configure_optimizers` must see this rank's parts, not the full
            # parameters that wrapping replaced.
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _sharded(self, model: nn.Module) -> ShardedModule:
        """Wrap the LightningModule, once: a later `fit`/`validate` on the same module reuses
        the wrapper (wrapping the module's parts again would shard the shards)."""
        if isinstance(model, ShardedModule):
            return model
        if self._sharded_module is not None and self._sharded_module.module is model:
            return self._sharded_module
        model = self.precision_plugin.convert_module(model)
        if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            model.to(self.root_device)
        sharded = self.options.wrap(model, self.precision_plugin.precision)
        self._sharded_module = sharded
        self.precision_plugin.sharded_module = sharded
        return sharded

    def model_to_device(self) -> None:
        # `ShardedModule` places the shards on the group's device when it wraps.
        pass

    @property
    def sharded_module(self) -> ShardedModule:
        if not isinstance(self.model, ShardedModule):
            raise RuntimeError("overlap: the model is wrapped in OverlapStrategy.setup (Trainer.fit/validate/...)")
        return self.model

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Batches that only accumulate gradients (`accumulate_grad_batches`) reduce nothing."""
        if isinstance(self.model, ShardedModule):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        # Not Strategy.teardown: moving the LightningModule to the CPU would replace the
        # parameters that are views of the flat shards.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- collectives on the sharding group ----------------------------------------------------

    def _group(self) -> Optional[dist.ProcessGroup]:
        return self.options.process_group

    def reduce(self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[torch.Tensor, Any]:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self._group(), reduce_op=reduce_op)
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self._group())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        group = self._group()
        dist.broadcast_object_list(box, src if group is None else dist.get_global_rank(group, src), group=group)
        return box[0]

    # ---- checkpoints --------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True         # the wrapped model and its optimizer load in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False        # loaded by load_checkpoint, with the model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: each parameter a `ShardedTensor` over this rank's part (no gather)."""
        return self.sharded_module.state_dict()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The LightningModule's full state dict (CPU tensors) for inference, on rank 0 alone
        unless `rank0_only=False`; called on every rank."""
        return self.sharded_module.full_state_dict(rank0_only=rank0_only)

    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        if len(self.optimizers) > 1:
            raise NotImplementedError("overlap: checkpoints of OverlapStrategy hold one optimizer; "
                                      f"configure_optimizers returned {len(self.optimizers)}")
        return self.optimizers[0] if self.optimizers else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        """Every rank writes its parts to the directory `filepath`, no gather; the model and
        optimizer are taken live, the rest of Lightning's `checkpoint` is saved beside them."""
        if storage_options is not None:
            raise TypeError("OverlapStrategy.save_checkpoint: storage_options is not supported "
                            "(checkpoints are written by overlap.checkpoint, not a CheckpointIO)")
        path = self.broadcast(os.fspath(filepath))
        state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        optimizer = self._optimizer() if "optimizer_states" in checkpoint else None
        save_checkpoint(path, self.sharded_module, optimizer, state, TRAINER_STATE)

    def load_checkpoint(self, checkpoint_path: Union[str, os.PathLike],
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        optimizer = self._optimizer() if self._fitting else None
        return load_checkpoint(path, self.sharded_module, optimizer, TRAINER_STATE)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass                # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass                # loaded by load_checkpoint

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="ZeRO-3 sharding by overlap.ShardedModule")


OverlapStrategy.register_strategies(StrategyRegistry)
