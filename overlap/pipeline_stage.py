"""What torch's pipelining asks of a stage's data-parallel module, answered by the runtime.

`torch.distributed.pipelining` plans a stage's gradients across the step's microbatches only for
modules it recognises: an `FSDPModule` is told, before each microbatch's backward, not to
reduce nor free (`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)`), and
at the stage's final gradient step it reads FSDP2's state (`fully_shard.state(stage)`) and calls
its root callback. Any other module reduces and regathers for every microbatch.

`overlap.fully_shard`'s modules are FSDPModules already. A `ShardedModule` built over one
pipeline stage's ranks (a mesh whose root mesh has a dimension named 'pp': `mesh["dp"]` of a
('pp', 'dp') mesh) becomes one too, so that both wraps plan alike: the step's gradients are
reduced once, after the last microbatch, and units stay gathered across microbatches as the
memory budget allows. Nothing else changes for it: its parameters stay the module's own.
"""
from __future__ import annotations

import types
from typing import Any, Optional

from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

PIPELINE_DIMENSION = "pp"


class PipelineGradStep:
    """What torch's pipelining reads of FSDP2's state at a stage's final gradient step, after
    every microbatch's backward ran without gradient sync: no per-group work, then the root
    callback, which reduces the held gradients once."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._state_ctx = types.SimpleNamespace(all_states=[self])
        self._fsdp_param_groups: tuple = ()

    def _root_post_backward_final_callback(self) -> None:
        self._runtime.scheduler.reduce_held_grads()


class Unsharded:
    """What `unshard(async_op=True)` returns (FSDP2's handle): the gather is complete when it returns."""

    def wait(self) -> None:
        return None


def register_grad_step(modules: list[nn.Module], runtime: Any) -> None:
    """Make `fully_shard.state(m)` give the runtime's final gradient step, for each of `modules`."""
    step = PipelineGradStep(runtime)
    for module in modules:
        # Keyed as torch's `fully_shard.state` reads it: by the function its decorator wraps.
        module.__dict__.setdefault(STATE_KEY, {})[getattr(torch_fully_shard, "__wrapped__", torch_fully_shard)] = step


def is_stage_mesh(mesh: Optional[DeviceMesh]) -> bool:
    """Whether `mesh` is part of a mesh with a pipeline dimension (anything else, None or not a
    mesh at all, is no stage; start-up refuses what is not a mesh)."""
    if not isinstance(mesh, DeviceMesh):
        return False
    return PIPELINE_DIMENSION in (mesh._get_root_mesh().mesh_dim_names or ())


def _refuse_fsdp_state(self: nn.Module) -> Any:
    raise NotImplementedError(f"{type(self).__name__}: a ShardedModule pipeline stage answers FSDP2's calls that "
                              "torch's pipelining makes (unshard, reshard, set_requires_gradient_sync, "
                              "set_reshard_after_backward, set_is_last_backward); for the others shard the stage "
                              "with overlap.fully_shard")


_STAGE_CLASSES: dict[type, type] = {}


def make_stage(module: nn.Module) -> None:
    """Make the ShardedModule `module` an `FSDPModule` to torch's pipelining (see the module note)."""
    cls = type(module)
    if cls not in _STAGE_CLASSES:
        # MRO [Stage<cls>, cls, ..., nn.Module, FSDPModule, object]: the ShardedModule's own
        # methods and nn.Module's come first; FSDPModule's others reach FSDP2's state, refused.
        _STAGE_CLASSES[cls] = type(f"Stage{cls.__name__}", (cls, FSDPModule),
                                   {"_get_fsdp_state": _refuse_fsdp_state, "__module__": cls.__module__})
    module.__class__ = _STAGE_CLASSES[cls]
    register_grad_step([module], module)
