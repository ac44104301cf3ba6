"""Compiled compute for the units: each member module's `forward` compiled with
`torch.compile` (Inductor), the runtime's hooks, gathers, frees and reductions outside the
compiled regions.

[Note: compiling forward, not __call__]
`module.compile()` (torchtitan's per-block recipe) compiles the module's `_call_impl`, hooks
included: Dynamo then traces the runtime's forward hooks and breaks the graph on each thing
they do that it cannot capture (clocks, profiler labels, `Work` futures, locks, mutation of
the `Unit`; docs/compile.md lists them). Compiling the module's `forward` instead leaves
`_call_impl` and its hooks eager: the pre-hook installs the gathered views, then the compiled
forward runs as one graph, then the post-hook frees. A module the user compiled before
wrapping is moved to this form (with torch.compile's default options: the ones the user gave
`module.compile()` are not kept by torch), so both routes give the same result.

The gathered parameters are views made anew at every gather and put in the module's
`__dict__`; Dynamo reads them as graph inputs guarded on dtype, shape and stride, not on
identity, so a new view every step does not recompile (checked in tests/test_compile.py).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger("overlap")


def eager_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, never traced by Dynamo: under `torch.compile(model)` it runs eagerly between
    compiled regions. It costs about 1 µs more per call than the bare function (measured on
    this CPU), and imports `torch._dynamo` at construction (1-3 s on this machine, once).
    `hook` stays readable as its `runtime_hook`: which ShardedModule or unit a module's hooks
    belong to."""
    disabled = torch._dynamo.disable(hook, recursive=True)
    disabled.runtime_hook = hook
    return disabled


def compile_modules(modules: Iterable[nn.Module]) -> None:
    """Compile each module's `forward` in place (see [Note: compiling forward, not __call__])."""
    for module in modules:
        if module._compiled_call_impl is not None:
            module._compiled_call_impl = None          # the user's `module.compile()`, moved to forward
        if not hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):   # not compiled yet
            module.forward = torch.compile(module.forward)


def compiled_by_user(module: nn.Module) -> bool:
    """Whether the user compiled `module` before wrapping (`module.compile()`)."""
    return module._compiled_call_impl is not None


class CompileTimeLog:
    """Logs once, at the end of the first step (where compilation happens), how long this rank
    spent compiling forward and backward, by Dynamo's own account."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.done = False

    def __call__(self, scheduler: object) -> None:
        if self.done:
            return
        self.done = True
        seconds = torch._dynamo.utils.calculate_time_spent()["total_wall_time"]
        logger.info("rank %d: compiled the units' compute in %.1f s", self.rank, seconds)
