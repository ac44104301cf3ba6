"""`OverlapTrainer`: a `transformers.Trainer` whose model trains sharded by `ShardedModule`.

Use it where `Trainer` would be used, with the sharding arguments beside the usual ones:

    trainer = OverlapTrainer(model=GPT2LMHeadModel(config), args=TrainingArguments(...),
                             train_dataset=dataset, unit_types=(GPT2Block,))
    trainer.train()                     # or train(resume_from_checkpoint=True)
    trainer.save_model("out")           # a Hugging Face folder: from_pretrained("out") loads it

What changes against a plain `Trainer`, and why:
- the model is wrapped when the trainer is made, so that the optimizer `Trainer` builds holds
  this rank's parts; Accelerate is told the wrapper is prepared already, so it does not wrap it
  again in DDP (`trainer.model_wrapped` is the `ShardedModule`);
- gradient accumulation goes through Accelerate's `no_sync(model)`, which finds
  `ShardedModule.no_sync`; clipping (`max_grad_norm`) is `ShardedModule.clip_grad_norm_`, over
  every rank's parts;
- `save_model` gathers the weights one unit at a time onto rank 0 (`full_state_dict`) and writes
  them with the model's own `save_pretrained`;
- a checkpoint folder holds that model folder, plus the model and optimizer sharded through
  `overlap.checkpoint` (each rank its parts, loadable at any world size) in place of
  `optimizer.pt`; `resume_from_checkpoint` loads them back.
- `bf16=True` gathers in bf16 and reduces in fp32 (`MixedPrecision`) in place of Accelerate's
  autocast; `fp16=True` is refused (its gradient scaler sees one rank's parts).
"""
from __future__ import annotations

import inspect
import math
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import can_return_loss, find_labels

from overlap import checkpoint
from overlap.base.mixed_precision import MixedPrecision
from overlap.integrations.options import ShardingOptions
from overlap.sharded_module import ShardedModule

__all__ = ["OverlapTrainer", "SHARDED_CHECKPOINT_DIR"]

# Inside each `checkpoint-N` folder: the sharded model and optimizer.
SHARDED_CHECKPOINT_DIR = "overlap_sharded"


class OverlapTrainer(Trainer):
    """`transformers.Trainer` training `model` wrapped in `ShardedModule`; the keyword
    arguments after `*` are `ShardedModule`'s (see its docstring), every other argument is
    `Trainer`'s. Launched by torchrun, the process group is made by `TrainingArguments` (or
    exists already)."""

    def __init__(self, model: nn.Module, args: Optional[TrainingArguments] = None, *positional: Any,
                 unit_types: Optional[Sequence[type]] = None, sharding: Optional[str] = None,
                 compression: Optional[str] = None, mixed_precision: Optional[MixedPrecision] = None,
                 prefetch_depth: Optional[int] = None, bucket_mb: Optional[float] = None,
                 reshard_after_forward: bool = True, param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 process_group: Optional[dist.ProcessGroup] = None, **kwargs: Any) -> None:
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if args.fp16:
            raise ValueError("OverlapTrainer: fp16=True needs a gradient scaler that sees every rank's gradients; "
                             "use bf16=True")
        # Accelerate's state, and with it the process group wrapping needs, is made on first use.
        _ = args.device
        if isinstance(model, ShardedModule):
            sharded = model
        else:
            options = ShardingOptions(
                unit_types=unit_types, sharding=sharding, compression=compression, mixed_precision=mixed_precision,
                prefetch_depth=prefetch_depth, bucket_mb=bucket_mb, reshard_after_forward=reshard_after_forward,
                param_init_fn=param_init_fn, process_group=process_group)
            sharded = options.wrap(model, "bf16-mixed" if args.bf16 else "32-true")
        # Accelerate's `prepare` returns a model marked prepared as it is: no DDP around the
        # shards (whose gradients ShardedModule reduces itself), no autocast wrapper.
        sharded._is_accelerate_prepared = True
        super().__init__(sharded, args, *positional, **kwargs)
        # What Trainer reads from the model's class and forward signature, read from the model
        # rather than from the wrapper's (*args, **kwargs).
        inner = type(sharded.module)
        if self.args.label_names is None:
            self.label_names = find_labels(inner)
        self.can_return_loss = can_return_loss(inner)

    @property
    def sharded_module(self) -> ShardedModule:
        return self.model

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            columns = list(inspect.signature(self.sharded_module.module.forward).parameters)
            self._signature_columns = columns + list(set(["label", "label_ids"] + self.label_names))

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # ShardedModule placed the shards on the group's device when it wrapped; `.to()` to a
        # device spelled differently ("cpu:0" for "cpu") would copy them, and the parameters
        # would no longer be views of the shards that the gathers send.
        pass

    # ---- clipping over every rank -------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.sharded_module.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Optional[Any] = None) -> Any:
        if grad_norm is None:
            # An infinite bound scales by 1: the norm over every rank, nothing clipped.
            grad_norm = self.sharded_module.clip_grad_norm_(math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---- a Hugging Face folder ----------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Every rank: gather the full weights onto rank 0, which writes them with the model's
        `save_pretrained` (and the tokenizer or processor, and the training arguments)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.sharded_module.full_state_dict(rank0_only=True)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            inner = self.sharded_module.module
            if hasattr(inner, "save_pretrained"):
                inner.save_pretrained(output_dir, state_dict=state)
            else:
                torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if dist.is_initialized():
            dist.barrier(group=self.sharded_module.collectives.all_group)

    # ---- sharded checkpoints ------------------------------------------------------------------

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        # Accelerate's AcceleratedOptimizer holds the optimizer the checkpoint knows.
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(os.path.join(output_dir, SHARDED_CHECKPOINT_DIR), self.sharded_module, self._torch_optimizer())
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        # The weights load with the optimizer state, from the sharded copy, once the optimizer exists.
        sharded = os.path.join(resume_from_checkpoint, SHARDED_CHECKPOINT_DIR)
        if not os.path.isdir(sharded):
            raise FileNotFoundError(f"OverlapTrainer: {resume_from_checkpoint} holds no {SHARDED_CHECKPOINT_DIR}/ "
                                    "(it was not written by OverlapTrainer)")

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the weights of the best checkpoint, from its sharded copy."""
        best = self.state.best_model_checkpoint
        checkpoint.load(os.path.join(best, SHARDED_CHECKPOINT_DIR), self.sharded_module)

    def _load_optimizer_and_scheduler(self, resume_from_checkpoint: Optional[str]) -> None:
        if resume_from_checkpoint is None:
            return
        checkpoint.load(os.path.join(resume_from_checkpoint, SHARDED_CHECKPOINT_DIR), self.sharded_module,
                        self._torch_optimizer())
        scheduler_file = os.path.join(resume_from_checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
