"""FSDP2's own test behaviours, ported case by case and run under FSDP2 and under ShardedModule.

Each case is a behaviour that one of PyTorch's FSDP2 tests checks (the registry at the end
names them), rewritten as a body that takes an implementation: the same model, seed and global
batch run under `fully_shard` (blocks, then the root, on a 1-D CPU mesh) and under
`ShardedModule` (the same blocks as units), and, where the behaviour is numeric, against one
process training on the whole global batch. Every rank runs the body; `run_case` turns what
each rank saw into one outcome per implementation:

- "pass": the behaviour held on every rank;
- "refused: <ErrorType: first words>": every rank raised the same error, on purpose (a `raise`
  in the implementation's own code, not an error from a tensor operation deep inside);
- "fail: <what>": wrong numbers, an internal error (a crash), ranks that disagree, or a hang.

tests/test_fsdp2_conformance.py runs every case at 1, 2 and 3 ranks; tests/conformance_table.py
writes docs/conformance.md from the same cases.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import functools
import linecache
import math
import os
import pickle
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

Precision = tuple[Optional[torch.dtype], Optional[torch.dtype]]     # (param_dtype, reduce_dtype)
UnitSpec = Union[nn.Module, list[nn.Module]]               # a list: one FSDP2 group of several modules
StepFn = Callable[[nn.Module, nn.Module, Any, int], torch.Tensor]


class Mismatch(Exception):
    """The behaviour did not hold (as opposed to an error raised by the implementation)."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Mismatch(what)


# ---- tolerances and comparisons -----------------------------------------------------------

@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float


FP32 = Tol(1e-4, 1e-6)          # other reduction orders than one process, nothing more
BF16 = Tol(5e-2, 1e-3)          # bf16 compute against an fp32 process
EXACT = Tol(0.0, 0.0)


def close(got: torch.Tensor, ref: torch.Tensor, tol: Tol) -> bool:
    got, ref = got.detach().double(), ref.detach().double()
    if tol == EXACT:
        return torch.equal(got, ref)
    return float((got - ref).norm()) <= tol.rtol * float(ref.norm()) + tol.atol * math.sqrt(max(ref.numel(), 1))


def check_tensors(what: str, got: dict[str, Optional[torch.Tensor]], ref: dict[str, Optional[torch.Tensor]],
                  tol: Tol) -> None:
    expect(sorted(got) == sorted(ref), f"{what} names {sorted(got)} != {sorted(ref)}")
    for name, expected in ref.items():
        value = got[name]
        if expected is None or value is None:
            expect(value is None and expected is None,
                   f"{what} {name}: {'None' if value is None else 'a tensor'}, one process has "
                   f"{'None' if expected is None else 'a tensor'}")
            continue
        expect(value.numel() == expected.numel(),
               f"{what} {name}: {value.numel()} elements, expected {expected.numel()}")
        value = value.reshape(expected.shape)
        diff = float((value.double() - expected.double()).norm())
        expect(close(value, expected, tol), f"{what} {name} differs from one process (|diff| {diff:.3g}, "
                                            f"|ref| {float(expected.double().norm()):.3g})")


def same_state(a: Any, b: Any, where: str = "state") -> None:
    """Nested state (dicts, lists, tensors, DTensors by their local parts) equal."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        expect(isinstance(a, DTensor) and isinstance(b, DTensor), f"{where}: a DTensor against a tensor")
        expect(a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        same_state(a.to_local(), b.to_local(), where)
    elif isinstance(a, torch.Tensor):
        expect(isinstance(b, torch.Tensor) and a.shape == b.shape and close(a, b, FP32), f"{where}: tensors differ")
    elif isinstance(a, dict):
        expect(isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)),
               f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b)) if isinstance(b, dict) else b}")
        for key in a:
            same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        expect(isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{where}[{i}]")
    else:
        expect(a == b, f"{where}: {a!r} != {b!r}")


def expect_raises(kind: type, words: str, fn: Callable[[], Any]) -> None:
    """`fn` raises `kind` with `words` in its message (another error is a mismatch too)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared with what the behaviour expects
        expect(isinstance(exc, kind) and words in str(exc),
               f"expected {kind.__name__} ({words!r}), got {type(exc).__name__}: {_first_words(exc)}")
        return
    raise Mismatch(f"expected {kind.__name__} ({words!r}), nothing raised")


# ---- the two implementations ---------------------------------------------------------------

@dataclass
class Ctx:
    rank: int
    world: int

    def local(self, batch: Any) -> Any:
        """This rank's rows of every tensor in `batch` (equal slices of dim 0)."""
        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            n = t.shape[0] // self.world
            return t[self.rank * n:(self.rank + 1) * n]
        return tree_map(cut, batch)


def plain_name(name: str) -> str:
    """Parameter names without activation-checkpoint wrappers' prefix."""
    return name.replace("_checkpoint_wrapped_module.", "")


class Impl:
    """What a case asks of an implementation: wrapping, this rank's parts, whole values."""
    name = ""

    def wrap(self, net: nn.Module, units: Sequence[UnitSpec], *, precision: Optional[Precision] = None,
             reshard_after_forward: bool = True, prefetch_two: bool = False, cpu_offload: bool = False) -> nn.Module:
        raise NotImplementedError

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter, a gradient or a state-dict value."""
        raise NotImplementedError

    def full(self, net: nn.Module, grads: bool) -> dict[str, Optional[torch.Tensor]]:
        """Whole parameters (or gradients) on every rank: each rank's part, joined in rank order
        (both shard dim 0 in whole rows, rank by rank), in one gather."""
        mine = {}
        for name, p in net.named_parameters():
            t = p.grad if grads else p
            mine[plain_name(name)] = None if t is None else self.local(t).detach().clone()
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        return {name: None if value is None else torch.cat([part[name].reshape(-1, *value.shape[1:]) for part in parts])
                for name, value in mine.items()}

    def full_params(self, net: nn.Module) -> dict[str, torch.Tensor]:
        return self.full(net, grads=False)

    def full_grads(self, net: nn.Module) -> dict[str, Optional[torch.Tensor]]:
        return self.full(net, grads=True)

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """A returned scalar (a total norm) as a plain tensor."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    def set_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)

    def register_forward_method(self, model: nn.Module, module: nn.Module, method: str) -> None:
        """What the implementation asks for before a unit (`module` inside `model`) is called
        through another method."""

    def after_exception(self, model: nn.Module) -> None:
        """What the implementation asks for after an exception inside forward."""


class Fsdp2(Impl):
    """`fully_shard` on each unit, then on the root, over a 1-D CPU mesh."""
    name = "fsdp2"

    def wrap(self, net: nn.Module, units: Sequence[UnitSpec], **options: Any) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        return self._shard(fully_shard, net, units, **options)

    @staticmethod
    def _shard(fully_shard: Callable, net: nn.Module, units: Sequence[UnitSpec], *,
               precision: Optional[Precision] = None, reshard_after_forward: bool = True, prefetch_two: bool = False,
               cpu_offload: bool = False) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        options: dict[str, Any] = {"mesh": _mesh(dist.get_world_size()), "reshard_after_forward": reshard_after_forward}
        if precision is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision[0], reduce_dtype=precision[1])
        if cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(net, **options)
        if prefetch_two:
            for i, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(list(units[i + 1:i + 3]))
                unit.set_modules_to_backward_prefetch(list(reversed(units[max(i - 2, 0):i])))
        return net

    def local(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def set_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)
        model.set_is_last_backward(sync)            # as FSDP2's own microbatching tests pair them

    def register_forward_method(self, model: nn.Module, module: nn.Module, method: str) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(module, method)

    def after_exception(self, model: nn.Module) -> None:
        model.reset_iter_state()


class Overlap(Impl):
    """`ShardedModule` with the units' classes as `unit_types`."""
    name = "overlap"

    def wrap(self, net: nn.Module, units: Sequence[UnitSpec], *, precision: Optional[Precision] = None,
             reshard_after_forward: bool = True, prefetch_two: bool = False, cpu_offload: bool = False) -> nn.Module:
        from overlap import MixedPrecision, ShardedModule

        flat = [m for unit in units for m in (unit if isinstance(unit, list) else [unit])]
        # Units are chosen by class; a tiny bucket keeps every block its own unit (as FSDP2's
        # groups are), and a fixed depth skips the link probe.
        return ShardedModule(net, unit_types=tuple(dict.fromkeys(type(m) for m in flat)),
                             mixed_precision=None if precision is None else MixedPrecision(*precision),
                             reshard_after_forward=reshard_after_forward, prefetch_depth=2 if prefetch_two else 1,
                             bucket_mb=1e-6, offload="cpu" if cpu_offload else None)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t.as_subclass(torch.Tensor)

    def register_forward_method(self, model: nn.Module, module: nn.Module, method: str) -> None:
        model.register_forward_method(module, method)


class OverlapFullyShard(Fsdp2):
    """`overlap.fully_shard`, called exactly as torch's is (the code written for FSDP2, with
    the import of `fully_shard` changed: torch's own `register_fsdp_forward_method` included)."""
    name = "overlap-fully-shard"

    def wrap(self, net: nn.Module, units: Sequence[UnitSpec], **options: Any) -> nn.Module:
        import overlap

        return self._shard(overlap.fully_shard, net, units, **options)


IMPLEMENTATIONS: tuple[Impl, ...] = (Fsdp2(), Overlap(), OverlapFullyShard())
# The implementations under test, against FSDP2 as the control.
OURS = ("overlap", "overlap-fully-shard")


@functools.lru_cache(maxsize=None)
def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


# ---- models ---------------------------------------------------------------------------------

class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: Optional[int] = None, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden or 2 * dim, bias=bias)
        self.out_proj = nn.Linear(hidden or 2 * dim, dim, bias=bias)
        self.seen_dtype: Optional[torch.dtype] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.out_proj(F.relu(self.in_proj(x)))
        self.seen_dtype = out.dtype
        return out


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Mixer(nn.Module):
    """Stands in for attention: a residual projection inside a block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class NestedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = Mixer(dim)
        self.ffn = Mlp(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix(self.norm(x))
        return x + self.ffn(x)


class TinyLM(nn.Module):
    VOCAB, DIM, SEQ = 33, 16, 8

    def __init__(self, n: int = 2, tie: bool = False, checkpointed: bool = False,
                 block: Callable[[int], nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.blocks = nn.ModuleList(block(self.DIM) for _ in range(n))
        self.norm = nn.LayerNorm(self.DIM)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


class ChunkedHead(nn.Module):
    """A body the forward runs, and a head it can skip for a caller to run in chunks."""
    VOCAB, DIM = 40, 16

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.body = nn.Linear(self.DIM, self.DIM, bias=False)
        self.norm = nn.RMSNorm(self.DIM)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


class Raiser(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("raised on purpose inside forward")
        return self.inner(x)


class First(nn.Linear):
    """A Linear of its own class, so that it alone becomes a unit."""


class TwoOutputs(nn.Module):
    def __init__(self, dim: int, use_second: bool) -> None:
        super().__init__()
        self.lin1 = First(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second = use_second

    def forward(self, x: torch.Tensor) -> Any:
        if self.use_second:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


# ---- data and training ----------------------------------------------------------------------

def tokens(step: int, ctx: Ctx, per_rank: int = 2, seq: int = TinyLM.SEQ, vocab: int = TinyLM.VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (per_rank * ctx.world, seq), generator=gen)


def features(step: int, ctx: Ctx, dim: int, per_rank: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(per_rank * ctx.world, dim, generator=gen)


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def lm_step(model: nn.Module, net: nn.Module, batch: torch.Tensor, index: int) -> torch.Tensor:
    logits = model(batch)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach()


def square_step(model: nn.Module, net: nn.Module, batch: Any, index: int) -> torch.Tensor:
    loss = model(batch).float().square().mean()
    loss.backward()
    return loss.detach()


def grads_of(net: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    return {plain_name(n): None if p.grad is None else p.grad.detach().clone() for n, p in net.named_parameters()}


def params_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {plain_name(n): p.detach().clone() for n, p in net.named_parameters()}


def check_loss(ctx: Ctx, loss: torch.Tensor, ref_loss: torch.Tensor, tol: Tol) -> None:
    """The mean of the ranks' losses against one process's loss on the whole batch."""
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    expect(close(total / ctx.world, ref_loss.float(), tol), f"loss {float(total / ctx.world):.6g} != "
                                                            f"one process's {float(ref_loss):.6g}")


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


@dataclass
class Run:
    """A distributed model (`model` wraps `net`) next to its one-process reference."""
    model: nn.Module
    net: nn.Module
    ref: nn.Module
    opt: torch.optim.Optimizer
    ref_opt: torch.optim.Optimizer


def build_pair(impl: Impl, build: Callable[[], nn.Module], units: Callable[[nn.Module], Sequence[UnitSpec]],
               optimizer: Callable[[Any], torch.optim.Optimizer] = adam, **wrap: Any) -> Run:
    net = seeded(build)
    model = impl.wrap(net, units(net), **wrap)
    ref = seeded(build)
    return Run(model, net, ref, optimizer(model.parameters()), optimizer(ref.parameters()))


def train_parity(impl: Impl, ctx: Ctx, build: Callable[[], nn.Module],
                 units: Callable[[nn.Module], Sequence[UnitSpec]], step: StepFn,
                 batches: Callable[[int, Ctx], Any], *, steps: int = 2, tol: Tol = FP32,
                 optimizer: Callable[[Any], torch.optim.Optimizer] = adam,
                 prepare: Optional[Callable[[Run], None]] = None, **wrap: Any) -> Run:
    """FSDP2's parity loop: each step's loss and gradients, and the final parameters, against
    one process on the global batch; zero_grad alternates between None and zeros. `prepare`
    runs on the wrapped model and the reference before the first step."""
    run = build_pair(impl, build, units, optimizer, **wrap)
    if prepare is not None:
        prepare(run)
    for i in range(steps):
        batch = batches(i, ctx)
        loss = step(run.model, run.net, ctx.local(batch), i)
        ref_loss = step(run.ref, run.ref, batch, i)
        check_loss(ctx, loss, ref_loss, tol)
        check_tensors(f"step {i} grad", impl.full_grads(run.net), grads_of(run.ref), tol)
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=i % 2 == 0)
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), tol)
    return run


def blocks(net: nn.Module) -> list[nn.Module]:
    return list(net.blocks)


def lm_batches(i: int, ctx: Ctx) -> torch.Tensor:
    return tokens(i, ctx)


# ---- cases: test_fully_shard_training.py ------------------------------------------------------

def root_no_forward_inputs(impl: Impl, ctx: Ctx) -> None:
    class WeightOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self) -> torch.Tensor:
            return self.weight @ self.weight

    def step(model: nn.Module, net: nn.Module, batch: Any, index: int) -> torch.Tensor:
        loss = model().square().mean()
        loss.backward()
        return loss.detach()

    train_parity(impl, ctx, WeightOnly, lambda net: [], step, lambda i, c: torch.zeros(c.world), steps=2)


def paramless_root_nested_inputs(impl: Impl, ctx: Ctx) -> None:
    class Paramless(nn.Module):
        def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return x + ys[0] + ys[1] + 1

    model = impl.wrap(Paramless(), [])
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    for _ in range(2):
        expect(torch.equal(model(x, ys), x + ys[0] + ys[1] + 1), "output differs from the module's")


def parameters_registered_after_backward(impl: Impl, ctx: Ctx) -> None:
    def unregistered(net: nn.Module) -> list[str]:
        return [f"{prefix}.{name}".lstrip(".") for prefix, module in net.named_modules()
                for name, p in module.named_parameters(recurse=False) if getattr(module, name) is not p]

    for units in (lambda n: [], blocks):
        run = build_pair(impl, TinyLM, units)
        out = run.model(ctx.local(tokens(0, ctx)))
        expect(not unregistered(run.net), f"after forward, attributes not the parameters: {unregistered(run.net)}")
        F.cross_entropy(out.flatten(0, 1), ctx.local(tokens(0, ctx)).flatten()).backward()
        expect(not unregistered(run.net), f"after backward, attributes not the parameters: {unregistered(run.net)}")


def single_group_uneven_shapes(impl: Impl, ctx: Ctx) -> None:
    for (a, b), (_, c) in ([(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        train_parity(impl, ctx, lambda: nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c)),
                     lambda net: [], square_step, lambda i, c_: features(i, c_, a), steps=3)


def multi_group_reshard(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, TinyLM, blocks, lm_step, lm_batches, steps=3)


def multi_group_keep_gathered(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, TinyLM, blocks, lm_step, lm_batches, steps=3, reshard_after_forward=False)


def cpu_offload(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, TinyLM, blocks, lm_step, lm_batches, cpu_offload=True)


def non_root_forward_backward(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, lambda: nn.Sequential(*[Mlp(16) for _ in range(3)]), list)
    batch = features(0, ctx, 16)
    for i, call in enumerate((lambda model, net: model, lambda model, net: net[0])):
        loss = square_step(call(run.model, run.net), run.net, ctx.local(batch), i)
        ref_loss = square_step(call(run.ref, run.ref), run.ref, batch, i)
        check_loss(ctx, loss, ref_loss, FP32)
        check_tensors(f"step {i} grad", impl.full_grads(run.net), grads_of(run.ref), FP32)
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        check_loss(ctx, run.model(ctx.local(batch)).square().mean(), run.ref(batch).square().mean(), FP32)


def _pre_hooks_read_weights(impl: Impl, ctx: Ctx, grad_mode: bool) -> None:
    """Forward pre-hooks registered on each unit after wrapping read the unit's parameters."""
    run = build_pair(impl, _mlps, list)
    seen: dict[str, torch.Tensor] = {}
    for index, unit in enumerate(run.net):
        def hook(module: nn.Module, args: Any, index: int = index) -> None:
            for name, p in module.named_parameters():
                expect(p.is_contiguous(), f"{index}.{name} is not contiguous in a pre-hook")
                seen[f"{index}.{name}"] = p.detach().clone()
        unit.register_forward_pre_hook(hook)
    with torch.set_grad_enabled(grad_mode):
        out = run.model(ctx.local(_mlp_batches(0, ctx)))
    if grad_mode:
        out.square().mean().backward()
    check_tensors("weight read by a pre-hook", seen, params_of(run.ref), EXACT)


def pre_hook_reads_weights(impl: Impl, ctx: Ctx) -> None:
    _pre_hooks_read_weights(impl, ctx, grad_mode=False)


def pre_hook_reads_weights_grad_mode(impl: Impl, ctx: Ctx) -> None:
    _pre_hooks_read_weights(impl, ctx, grad_mode=True)


def module_called_twice(impl: Impl, ctx: Ctx) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = First(4, 4)
            self.outer = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(self.inner(x) + self.inner(x))

    train_parity(impl, ctx, Twice, lambda net: [net.inner], square_step, lambda i, c: features(i, c, 4, 4))


def prefetch_two_ahead(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, lambda: TinyLM(n=4), blocks, lm_step, lm_batches, prefetch_two=True,
                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))


def activation_checkpointing_utils(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, lambda: TinyLM(checkpointed=True), blocks, lm_step, lm_batches)


def activation_checkpointing_wrapper(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    def units(net: nn.Module) -> list[nn.Module]:
        apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, Block))
        return list(net.blocks)

    train_parity(impl, ctx, TinyLM, units, lm_step, lm_batches)


def activation_checkpointing_composable(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def units(net: nn.Module) -> list[nn.Module]:
        for block in net.blocks:
            composable_checkpoint(block)
        return list(net.blocks)

    train_parity(impl, ctx, TinyLM, units, lm_step, lm_batches)


def tied_embedding_head(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, lambda: TinyLM(tie=True), blocks, lm_step, lm_batches)


def _chunked_step(chunks: int = 4) -> StepFn:
    """Forward without the head, the head run by the caller on chunks of the hidden states
    (each chunk its own backward), then the hidden states' backward."""
    def step(model: nn.Module, net: nn.Module, batch: torch.Tensor, index: int) -> torch.Tensor:
        h = model(batch, skip_head=True)
        grads, total = [], torch.zeros(())
        for chunk in torch.chunk(h.detach(), chunks, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            loss = net.head(chunk).float().square().sum() / (batch.shape[0] * 100)
            loss.backward()
            grads.append(chunk.grad)
            total = total + loss.detach()
        h.backward(torch.cat(grads, dim=1))
        return total
    return step


def _chunked_batches(i: int, ctx: Ctx) -> torch.Tensor:
    return tokens(i, ctx, seq=16, vocab=ChunkedHead.VOCAB)


def chunked_head_outside_forward(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, ChunkedHead, lambda n: [n.embed, n.body, n.norm, n.head], _chunked_step(),
                 _chunked_batches)


def tied_head_outside_forward(impl: Impl, ctx: Ctx) -> None:
    # FSDP2 needs tied modules in one group (its test groups [embed, norm, head]).
    train_parity(impl, ctx, lambda: ChunkedHead(tie=True), lambda n: [n.body, [n.embed, n.norm, n.head]],
                 _chunked_step(), _chunked_batches)


def accumulate(impl: Impl, ctx: Ctx, run: Run, step: StepFn, batches: Sequence[Any], tol: Tol = FP32) -> None:
    """Microbatches with gradient synchronisation on the last only, against one process."""
    for i, batch in enumerate(batches):
        impl.set_sync(run.model, i == len(batches) - 1)
        step(run.model, run.net, ctx.local(batch), i)
        step(run.ref, run.ref, batch, i)
    check_tensors("accumulated grad", impl.full_grads(run.net), grads_of(run.ref), tol)


def chunked_head_grad_accumulation(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, ChunkedHead, lambda n: [n.embed, n.body, n.norm, n.head])
    accumulate(impl, ctx, run, _chunked_step(2), [_chunked_batches(i, ctx) for i in range(3)])


def exception_in_forward_recovers(impl: Impl, ctx: Ctx) -> None:
    def build() -> nn.Module:
        net = ChunkedHead()
        net.body = Raiser(net.body)
        return net

    def raise_once(run: Run) -> None:
        run.net.body.armed = True
        batch = ctx.local(_chunked_batches(0, ctx))
        expect_raises(RuntimeError, "on purpose", lambda: run.model(batch, skip_head=True))
        run.net.body.armed = False
        impl.after_exception(run.model)

    train_parity(impl, ctx, build, lambda n: [[n.norm, n.head]], square_step, _chunked_batches, prepare=raise_once)


def two_forwards_before_backward(impl: Impl, ctx: Ctx) -> None:
    def step(model: nn.Module, net: nn.Module, batch: tuple, index: int) -> torch.Tensor:
        first, second = (F.cross_entropy(model(t).float().flatten(0, 1), t.roll(-1, 1).flatten()) for t in batch)
        loss = first + 0.5 * second
        loss.backward()
        return loss.detach()

    train_parity(impl, ctx, lambda: TinyLM(checkpointed=True), blocks, step,
                 lambda i, c: (tokens(2 * i, c), tokens(2 * i + 1, c)), steps=2)


def nested_units(impl: Impl, ctx: Ctx) -> None:
    def units(net: nn.Module) -> list[nn.Module]:
        return [m for block in net.blocks for m in (block.mix, block.ffn, block)]

    train_parity(impl, ctx, lambda: TinyLM(block=NestedBlock), units, lm_step, lm_batches)


def two_partial_forwards_unused_head(impl: Impl, ctx: Ctx) -> None:
    def step(model: nn.Module, net: nn.Module, batch: tuple, index: int) -> torch.Tensor:
        loss = sum(model(t, skip_head=True).float().mean() for t in batch)
        loss.backward()
        return loss.detach()

    run = train_parity(impl, ctx, ChunkedHead, lambda n: [[n.norm, n.head]], step,
                       lambda i, c: (_chunked_batches(2 * i, c), _chunked_batches(2 * i + 1, c)), steps=1)
    expect(run.net.head.weight.grad is None, "the unused head has a gradient")


class TiedPair(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, 16)
        self.out = nn.Linear(16, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.tok(ids))


def tied_uneven_rows_all_updated(impl: Impl, ctx: Ctx) -> None:
    vocab = 4 * ctx.world + 1

    def step(model: nn.Module, net: nn.Module, ids: torch.Tensor, index: int) -> torch.Tensor:
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach()

    run = train_parity(impl, ctx, lambda: TiedPair(vocab), lambda n: [[n.tok, n.out]], step,
                       lambda i, c: tokens(i, c, vocab=vocab), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    initial = seeded(lambda: TiedPair(vocab)).tok.weight
    final = impl.full_params(run.net)["tok.weight"]
    expect(all(not torch.equal(initial[r], final[r]) for r in range(vocab)), "a row of the tied weight never changed")


def tied_across_separate_units(impl: Impl, ctx: Ctx) -> None:
    vocab = 17
    run = build_pair(impl, lambda: TiedPair(vocab), lambda n: [n.tok, n.out])
    batch = tokens(0, ctx, vocab=vocab)
    try:
        logits = run.model(ctx.local(batch))
    except ValueError:
        return          # FSDP2's documented answer: tied parameters must share a group
    loss = F.cross_entropy(logits.float().flatten(0, 1), ctx.local(batch).flatten())
    loss.backward()
    F.cross_entropy(run.ref(batch).flatten(0, 1), batch.flatten()).backward()
    check_tensors("grad", impl.full_grads(run.net), grads_of(run.ref), FP32)


def grad_accumulation_no_sync(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, lambda: nn.Sequential(nn.Linear(16, 16), *[Mlp(16) for _ in range(3)]),
                     lambda n: list(n)[1:])
    for it in range(2):
        accumulate(impl, ctx, run, square_step, [features(3 * it + i, ctx, 16) for i in range(3)])
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=it % 2 == 1)      # zeros first: accumulation onto existing grads
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), FP32)


def microbatches_keep_gathered(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, TinyLM, blocks, reshard_after_forward=False)
    accumulate(impl, ctx, run, lm_step, [tokens(i, ctx) for i in range(3)])
    for opt in (run.opt, run.ref_opt):
        opt.step()
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), FP32)


def forward_method_not_forward(impl: Impl, ctx: Ctx) -> None:
    class Patches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Conv2d(3, 8, kernel_size=4, stride=4)

        def forward_features(self, images: torch.Tensor) -> torch.Tensor:
            return self.proj(images).flatten(2).transpose(1, 2)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.forward_features(images).sum(1)

    class Vision(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = Patches()
            self.projector = nn.Linear(8, 4)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.projector(self.vit.forward_features(images))

    def units(net: nn.Module) -> list[nn.Module]:
        return [net.vit, net.projector]

    def batches(i: int, c: Ctx) -> torch.Tensor:
        return torch.randn(2 * c.world, 3, 8, 8, generator=torch.Generator().manual_seed(i))

    train_parity(impl, ctx, Vision, units, square_step, batches,
                 prepare=lambda run: impl.register_forward_method(run.model, run.net.vit, "forward_features"))


# ---- cases: test_fully_shard_frozen.py ---------------------------------------------------------

def _mlps() -> nn.Module:
    return nn.Sequential(*[Mlp(16) for _ in range(3)])


def _freeze_weights(net: nn.Module) -> None:
    for name, p in net.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


def _mlp_batches(i: int, ctx: Ctx) -> torch.Tensor:
    return features(i, ctx, 16, per_rank=4)


def frozen_weights_train_biases(impl: Impl, ctx: Ctx) -> None:
    def build() -> nn.Module:
        net = _mlps()
        _freeze_weights(net)
        return net

    train_parity(impl, ctx, build, list, square_step, _mlp_batches)


def frozen_weights_with_checkpointing(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def build() -> nn.Module:
        net = _mlps()
        _freeze_weights(net)
        return net

    def units(net: nn.Module) -> list[nn.Module]:
        for mlp in net:
            composable_checkpoint(mlp)
        return list(net)

    train_parity(impl, ctx, build, units, square_step, _mlp_batches)


def freeze_after_wrap(impl: Impl, ctx: Ctx) -> None:
    def freeze(run: Run) -> None:
        for net in (run.net, run.ref):
            _freeze_weights(net)

    train_parity(impl, ctx, _mlps, list, square_step, _mlp_batches, steps=3, prepare=freeze)


def _linears() -> nn.Module:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.ReLU())])


def _set_every_other(net: nn.Module, requires_grad: bool) -> None:
    for i, lin in enumerate(m for m in net if isinstance(m, nn.Linear)):
        if i % 2 == 0:
            lin.requires_grad_(requires_grad)


def _interleaved(impl: Impl, ctx: Ctx, unfreeze_last: bool) -> None:
    def build() -> nn.Module:
        net = _linears()
        _set_every_other(net, False)
        return net

    run = build_pair(impl, build, lambda n: [m for m in n if isinstance(m, nn.Linear)])
    batch = _mlp_batches(0, ctx)
    for i in range(3):
        if unfreeze_last and i == 2:
            for net in (run.net, run.ref):
                _set_every_other(net, True)
        if i == 1:
            with torch.no_grad():
                check_loss(ctx, run.model(ctx.local(batch)).square().mean(), run.ref(batch).square().mean(), FP32)
            continue
        check_loss(ctx, square_step(run.model, run.net, ctx.local(batch), i), square_step(run.ref, run.ref, batch, i),
                   FP32)
        check_tensors(f"step {i} grad", impl.full_grads(run.net), grads_of(run.ref), FP32)
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=i % 2 == 0)
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), FP32)


def frozen_units_interleaved(impl: Impl, ctx: Ctx) -> None:
    _interleaved(impl, ctx, unfreeze_last=False)


def unfreeze_after_wrap(impl: Impl, ctx: Ctx) -> None:
    _interleaved(impl, ctx, unfreeze_last=True)


def frozen_module_called_repeatedly(impl: Impl, ctx: Ctx) -> None:
    class Repeats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_0 = nn.Linear(5, 5)
            self.frozen = nn.Linear(5, 5)
            self.trained = nn.Linear(5, 5)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer_0(x)
            for _ in range(3):
                x = self.frozen(F.relu(self.trained(x)))
                with torch.no_grad():
                    x += F.relu(self.trained(x))
            return x

    train_parity(impl, ctx, Repeats, lambda n: [n.layer_0, n.frozen, n.trained], square_step,
                 lambda i, c: features(i, c, 5, 4))


# ---- cases: test_fully_shard_autograd.py --------------------------------------------------------

def unused_forward_output(impl: Impl, ctx: Ctx) -> None:
    def step(model: nn.Module, net: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
        out1, out2 = model(x)
        loss = (out1 * out2).mean() if index == 0 else out1.mean()
        loss.backward()
        return loss.detach()

    train_parity(impl, ctx, lambda: TwoOutputs(24, use_second=True), lambda n: [n.lin1], step,
                 lambda i, c: features(i, c, 24), steps=3)


def unused_forward_module(impl: Impl, ctx: Ctx) -> None:
    train_parity(impl, ctx, lambda: TwoOutputs(24, use_second=False), lambda n: [n.lin1, n.lin2], square_step,
                 lambda i, c: features(i, c, 24))


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Fields:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Fields
    z: torch.Tensor


def _pack(kind: str, x: torch.Tensor, rest: Any = None) -> Any:
    rest = torch.ones_like(x) if rest is None else rest
    return {"list": lambda: [x], "tuple": lambda: (x,), "dict": lambda: {"x": x},
            "namedtuple": lambda: Pair(x, rest), "dataclass": lambda: Fields(x, rest),
            "nested_dataclass": lambda: Outer(Fields(x, rest), rest)}[kind]()


def _first(kind: str, packed: Any) -> torch.Tensor:
    if kind == "dict":
        return packed["x"]
    if kind in ("list", "tuple"):
        return packed[0]
    return packed.inner.x if kind == "nested_dataclass" else packed.x


def _rest(kind: str, packed: Any) -> Any:
    return None if kind in ("list", "tuple", "dict") else (packed.z if kind == "nested_dataclass" else packed.y)


class Packed(nn.Module):
    """Computes on the first tensor of a container and returns the same kind of container."""

    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.seen_dtype: Optional[torch.dtype] = None

    def forward(self, packed: Any) -> Any:
        out = F.relu(self.lin2(F.relu(self.lin1(_first(self.kind, packed)))))
        self.seen_dtype = out.dtype
        rest = _rest(self.kind, packed)
        return _pack(self.kind, out, None if rest is None else rest * 0.5 + out)


class Container(nn.Module):
    def __init__(self, kind: str, dim: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.Sequential(*[Packed(kind, dim) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.layers(_pack(self.kind, x))
        rest = _rest(self.kind, packed)
        return _first(self.kind, packed) + (0 if rest is None else rest)


def _containers(impl: Impl, ctx: Ctx, kinds: Sequence[str], precision: Optional[Precision] = None,
                tol: Tol = FP32) -> None:
    for kind in kinds:
        run = train_parity(impl, ctx, lambda: Container(kind), lambda n: list(n.layers), square_step,
                           lambda i, c: features(i, c, 16), steps=1, tol=tol, precision=precision)
        if precision is not None:
            expect(all(m.seen_dtype == precision[0] for m in run.net.layers), "a layer computed in another dtype")


def container_activations(impl: Impl, ctx: Ctx) -> None:
    _containers(impl, ctx, ["list", "namedtuple", "tuple", "dict"])


def dataclass_activations(impl: Impl, ctx: Ctx) -> None:
    _containers(impl, ctx, ["dataclass", "nested_dataclass"])


def namedtuple_activations_mixed_precision(impl: Impl, ctx: Ctx) -> None:
    _containers(impl, ctx, ["namedtuple"], precision=(torch.bfloat16, torch.float32), tol=BF16)


def post_accumulate_grad_hook_runs_once(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, lambda: Mlp(8), lambda n: [n.in_proj, n.out_proj])
    counts: collections.Counter = collections.Counter()
    for name, p in run.net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda param, name=name: counts.update([name]))
    square_step(run.model, run.net, ctx.local(features(0, ctx, 8)), 0)
    expect(dict(counts) == {n: 1 for n, _ in run.net.named_parameters()}, f"hook calls per parameter: {dict(counts)}")


def optimizer_in_backward_hook(impl: Impl, ctx: Ctx) -> None:
    def per_parameter_optimizers(net: nn.Module) -> None:
        for p in net.parameters():
            opt = torch.optim.AdamW([p], lr=1e-2, foreach=False)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

            def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt, schedule: Any = schedule) -> None:
                opt.step()
                opt.zero_grad()
                schedule.step()
            p.register_post_accumulate_grad_hook(hook)

    run = build_pair(impl, TinyLM, blocks)
    for net in (run.net, run.ref):
        per_parameter_optimizers(net)
    for i in range(3):
        batch = tokens(i, ctx)
        check_loss(ctx, lm_step(run.model, run.net, ctx.local(batch), i), lm_step(run.ref, run.ref, batch, i), FP32)
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), FP32)


# ---- cases: test_fully_shard_mixed_precision.py ----------------------------------------------------

def _mixed(impl: Impl, ctx: Ctx, precision: Precision) -> None:
    run = train_parity(impl, ctx, _mlps, list, square_step, _mlp_batches, tol=BF16, precision=precision)
    compute = precision[0] or torch.float32
    expect(all(m.seen_dtype == compute for m in run.net), "a block computed in another dtype")
    square_step(run.model, run.net, ctx.local(_mlp_batches(9, ctx)), 9)
    expect(all(impl.local(p.grad).dtype == torch.float32 for p in run.net.parameters()),
           "gradients are not in the parameters' dtype")


def bf16_compute_bf16_reduce(impl: Impl, ctx: Ctx) -> None:
    _mixed(impl, ctx, (torch.bfloat16, None))


def bf16_compute_fp32_reduce(impl: Impl, ctx: Ctx) -> None:
    _mixed(impl, ctx, (torch.bfloat16, torch.float32))


def fp32_compute_bf16_reduce(impl: Impl, ctx: Ctx) -> None:
    _mixed(impl, ctx, (None, torch.bfloat16))


def grad_accumulation_bf16_fp32_reduce(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, _mlps, list, precision=(torch.bfloat16, torch.float32))
    for it in range(2):
        accumulate(impl, ctx, run, square_step, [_mlp_batches(4 * it + i, ctx) for i in range(4)], BF16)
        expect(all(p.grad.dtype == torch.float32 for p in run.net.parameters()), "accumulated grads are not fp32")
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=it % 2 == 0)
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), BF16)


class Recorder(nn.Linear):
    """Records the dtypes of what reaches it."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim, bias=False)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.seen += [x.dtype] + ([] if extra is None else [extra.dtype])
        out = super().forward(x)
        return out if extra is None else out + extra


def unit_input_cast(impl: Impl, ctx: Ctx) -> None:
    class Casting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = Recorder(16), Recorder(16), Recorder(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.b(self.a(x).float())                   # an fp32 tensor made inside forward
            return self.c(h, torch.ones(h.shape))           # and one that comes from nowhere

    run = build_pair(impl, Casting, lambda n: [n.a, n.b, n.c], precision=(torch.bfloat16, torch.float32))
    out = run.model(ctx.local(_mlp_batches(0, ctx)))
    expect(out.dtype == torch.bfloat16, f"output dtype {out.dtype}")
    out.float().square().mean().backward()
    seen = {name: getattr(run.net, name).seen for name in "abc"}
    expect(all(dtype == torch.bfloat16 for dtypes in seen.values() for dtype in dtypes), f"unit inputs: {seen}")
    expect(all(p.grad is not None for p in run.net.parameters()), "a parameter got no gradient")


def checkpoint_recompute_casts(impl: Impl, ctx: Ctx) -> None:
    class Recompute(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear1 = Recorder(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.linear1, x.float(), use_reentrant=False, early_stop=False).float().sum()

    run = build_pair(impl, Recompute, lambda n: [n.linear1], precision=(torch.bfloat16, torch.float32))
    run.model(ctx.local(features(0, ctx, 4, 4))).backward()
    seen = run.net.linear1.seen
    expect(seen == [torch.bfloat16, torch.bfloat16], f"forward then recompute saw {seen}")


def norm_layers_bf16(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, lambda: nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)), list,
                     precision=(torch.bfloat16, torch.float32))
    out = run.model(ctx.local(features(0, ctx, 32, 4)))
    expect(out.dtype == torch.bfloat16, f"output dtype {out.dtype}")
    out.float().sum().backward()
    expect(all(p.grad is not None for p in run.net.parameters()), "a parameter got no gradient")


def cast_after_wrap(impl: Impl, ctx: Ctx) -> None:
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)     # as FSDP2's test runs it
    try:
        _cast_after_wrap(impl, ctx)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _cast_after_wrap(impl: Impl, ctx: Ctx) -> None:
    def to_float64(run: Run) -> None:
        run.model.to(torch.float64)
        run.ref.to(torch.float64)
        run.opt, run.ref_opt = adam(run.model.parameters()), adam(run.ref.parameters())
        expect(all(p.dtype == torch.float64 for p in run.net.parameters()), "parameters are not float64 after .to()")

    run = train_parity(impl, ctx, lambda: Mlp(4), lambda n: [n.in_proj, n.out_proj], square_step,
                       lambda i, c: features(i, c, 4).double(), steps=3, prepare=to_float64)
    square_step(run.model, run.net, ctx.local(features(9, ctx, 4).double()), 9)
    expect(all(impl.local(p.grad).dtype == torch.float64 for p in run.net.parameters()), "gradients are not float64")


# ---- cases: test_fully_shard_clip_grad_norm_.py ------------------------------------------------------

def _clip(impl: Impl, ctx: Ctx, norm_type: float, foreach: Optional[bool] = True) -> None:
    run = build_pair(impl, TinyLM, blocks)
    max_norm = 1e-2
    for i in range(2):
        batch = tokens(i, ctx)
        lm_step(run.model, run.net, ctx.local(batch), i)
        lm_step(run.ref, run.ref, batch, i)
        check_tensors(f"step {i} grad", impl.full_grads(run.net), grads_of(run.ref), FP32)
        ref_total = torch.nn.utils.clip_grad_norm_(run.ref.parameters(), max_norm, norm_type)
        expect(float(ref_total) > max_norm, "the clip would not bind")
        total = impl.value(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm, norm_type, foreach=foreach))
        expect(close(total, ref_total, FP32), f"total norm {float(total):.6g} != one process's {float(ref_total):.6g}")
        check_tensors(f"step {i} clipped grad", impl.full_grads(run.net), grads_of(run.ref), FP32)
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad()
    check_tensors("parameter", impl.full_params(run.net), params_of(run.ref), FP32)


def clip_grad_norm_l2(impl: Impl, ctx: Ctx) -> None:
    _clip(impl, ctx, 2.0)


def clip_grad_norm_l1(impl: Impl, ctx: Ctx) -> None:
    _clip(impl, ctx, 1.0)


def clip_grad_norm_inf(impl: Impl, ctx: Ctx) -> None:
    _clip(impl, ctx, math.inf)


def clip_grad_norm_inf_per_tensor(impl: Impl, ctx: Ctx) -> None:
    _clip(impl, ctx, math.inf, foreach=None)          # CPU's default: each gradient's norm on its own


# ---- cases: test_fully_shard_grad_scaler.py ------------------------------------------------------------

def _grad_scaler(impl: Impl, ctx: Ctx, inf_on_last_rank: bool) -> None:
    """With `inf_on_last_rank`, the last rank holding part of the first weight writes an inf into it."""
    run = build_pair(impl, lambda: nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)), list)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(run.model(ctx.local(features(0, ctx, 4))).sum()).backward()
    params = list(run.net.parameters())
    holders: list[Any] = [None] * ctx.world
    dist.all_gather_object(holders, impl.local(params[0].grad).numel())
    if inf_on_last_rank and ctx.rank == max(r for r, n in enumerate(holders) if n > 0):
        with torch.no_grad():
            impl.local(params[0].grad).view(-1)[0] = math.inf
    before = [impl.local(p.grad).clone() for p in params]
    scaler.unscale_(run.opt)
    expect(all(torch.equal(impl.local(p.grad), b * 0.5) for p, b in zip(params, before)), "unscale_ did not halve")
    start = impl.full_params(run.net)
    scaler.step(run.opt)
    scaler.update()
    moved = any(not torch.equal(v, start[k]) for k, v in impl.full_params(run.net).items())
    found = torch.tensor([float(moved)])
    dist.all_reduce(found)          # the step must have been taken, or skipped, on every rank alike
    expect(float(found) in (0.0, ctx.world), "the step was skipped on some ranks only")
    if inf_on_last_rank:
        expect(not moved and scaler.get_scale() == 1.0, f"step taken {moved}, scale {scaler.get_scale()}")
    else:
        expect(moved and scaler.get_scale() == 2.0, f"step taken {moved}, scale {scaler.get_scale()}")


def grad_scaler_finite(impl: Impl, ctx: Ctx) -> None:
    _grad_scaler(impl, ctx, inf_on_last_rank=False)


def grad_scaler_inf_on_one_rank(impl: Impl, ctx: Ctx) -> None:
    _grad_scaler(impl, ctx, inf_on_last_rank=True)


# ---- cases: test_fully_shard_state_dict.py ---------------------------------------------------------------

def _nonempty_parts(impl: Impl, net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: impl.local(p) for n, p in net.named_parameters() if impl.local(p).numel() > 0}


def state_dict_values_share_parameter_storage(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.tensor import DTensor

    run = build_pair(impl, _mlps, list)
    with torch.no_grad():
        for p in run.net.parameters():
            p.fill_(1.0)
    state = run.model.state_dict()
    reference = run.ref.state_dict()
    expect(list(state) == list(reference), f"keys {list(state)} != {list(reference)}")
    for key, value in state.items():
        expect(isinstance(value, DTensor) and value.shape == reference[key].shape, f"{key} is not a full-shape DTensor")
    for name, part in _nonempty_parts(impl, run.net).items():
        expect(impl.local(state[name]).data_ptr() == part.data_ptr(), f"{name}: not the parameter's storage")


def state_dict_load_new_values(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, _mlps, list)
    fill = 42.0 + ctx.rank
    new = {key: value.detach().clone().fill_(fill) for key, value in run.model.state_dict().items()}
    run.model.load_state_dict(new)
    for name, part in _nonempty_parts(impl, run.net).items():
        expect(bool((part == fill).all()), f"{name} did not take the loaded values")


def state_dict_after_forward_keep_gathered(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.tensor import DTensor

    run = build_pair(impl, _mlps, list, reshard_after_forward=False)
    before = {k: impl.local(v).clone() for k, v in run.model.state_dict().items()}
    run.model(ctx.local(_mlp_batches(0, ctx)))
    after = run.model.state_dict()
    expect(list(after) == list(before), "keys changed after a forward")
    for key, value in after.items():
        expect(isinstance(value, DTensor) and torch.equal(impl.local(value), before[key]), f"{key} changed")


def state_dict_tracks_training(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, lambda: nn.Linear(5, 5, bias=False), lambda n: [],
                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    state = run.model.state_dict()
    first = impl.local(state["weight"]).clone()
    for i in range(3):
        square_step(run.model, run.net, ctx.local(features(i, ctx, 5, 5)), i)
        run.opt.step()
        run.opt.zero_grad()
    part = impl.local(dict(run.net.named_parameters())["weight"])
    now = impl.local(state["weight"])
    expect(torch.equal(now, part) and now.data_ptr() == part.data_ptr(), "the state dict no longer holds the weight")
    expect(part.numel() == 0 or not torch.equal(now, first), "training did not change the weight")


def state_dict_full_tensor_rank0(impl: Impl, ctx: Ctx) -> None:
    run = build_pair(impl, TinyLM, blocks)
    full = {}
    for key, value in run.model.state_dict().items():
        whole = value.full_tensor()
        if ctx.rank == 0:
            full[key] = whole.cpu()
    if ctx.rank == 0:
        reference = run.ref.state_dict()
        expect(list(full) == list(reference), "keys differ from the module's")
        check_tensors("state", full, reference, EXACT)


# ---- cases: checkpoint/test_state_dict.py (FSDP2 paths) -----------------------------------------------

def _train_steps(run: Run, ctx: Ctx, first: int, last: int) -> None:
    for i in range(first, last):
        batch = tokens(i, ctx)
        lm_step(run.model, run.net, ctx.local(batch), i)
        lm_step(run.ref, run.ref, batch, i)
        for opt in (run.opt, run.ref_opt):
            opt.step()
            opt.zero_grad()


def dsd_sharded_roundtrip(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_optimizer_state_dict

    for reshard in (True, False):
        run = build_pair(impl, TinyLM, lambda n: [], reshard_after_forward=reshard)
        _train_steps(run, ctx, 0, 1)
        model_state, optim_state = get_state_dict(run.model, optimizers=run.opt)
        net = seeded(TinyLM, seed=7)
        fresh = impl.wrap(net, [], reshard_after_forward=reshard)
        opt = adam(fresh.parameters())
        set_model_state_dict(fresh, model_state)
        set_optimizer_state_dict(fresh, opt, optim_state)
        check_tensors("loaded parameter", impl.full_params(net), params_of(run.ref), FP32)
        _train_steps(Run(fresh, net, run.ref, opt, run.ref_opt), ctx, 1, 2)
        check_tensors("parameter after a step", impl.full_params(net), params_of(run.ref), FP32)


def dsd_strict_keys(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    run = build_pair(impl, TinyLM, lambda n: [])
    state = get_model_state_dict(run.model)
    state["abc"] = torch.zeros(10)
    expect_raises(RuntimeError, "Unexpected key", lambda: set_model_state_dict(run.model, state))
    dropped = next(k for k in state if k != "abc")
    state.pop(dropped)
    keys = set_model_state_dict(run.model, state, options=StateDictOptions(strict=False))
    expect(list(keys.missing_keys) == [dropped] and list(keys.unexpected_keys) == ["abc"], f"incompatible keys {keys}")
    state.pop("abc")
    expect_raises(RuntimeError, "Missing key", lambda: set_model_state_dict(run.model, state))


def _is_plain_cpu(tree: Any) -> bool:
    from torch.distributed.tensor import DTensor

    leaves = []
    tree_map(lambda t: leaves.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return all(not isinstance(t, DTensor) and t.device.type == "cpu" for t in leaves)


def dsd_full_and_cpu_offload(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    run = build_pair(impl, TinyLM, blocks)
    _train_steps(run, ctx, 0, 1)
    reference = get_state_dict(run.ref, optimizers=run.ref_opt)
    model_state, optim_state = get_state_dict(run.model, optimizers=run.opt,
                                              options=StateDictOptions(full_state_dict=True))
    expect(_is_plain_cpu((model_state, optim_state)), "full state dicts hold DTensors")
    same_state(model_state, reference[0], "model")
    same_state(optim_state, reference[1], "optimizer")
    model_state, optim_state = get_state_dict(run.model, optimizers=run.opt,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        expect(_is_plain_cpu((model_state, optim_state)), "offloaded state is not plain CPU tensors")
        same_state(model_state, reference[0], "model")
        same_state(optim_state, reference[1], "optimizer")
    else:
        expect(model_state == {} and optim_state == {}, "ranks other than 0 hold offloaded state")


def dsd_broadcast_from_rank0(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    run = build_pair(impl, TinyLM, lambda n: [])
    _train_steps(run, ctx, 0, 1)
    model_state, optim_state = copy.deepcopy(get_state_dict(run.ref, optimizers=run.ref_opt))

    def matches() -> bool:
        got = (get_model_state_dict(run.model, options=full),
               get_optimizer_state_dict(run.model, run.opt, options=full))
        try:
            same_state(got, (model_state, optim_state))
            return True
        except Mismatch:
            return False

    expect(matches(), "full state differs from one process's")
    lm_step(run.model, run.net, ctx.local(tokens(5, ctx)), 5)
    run.opt.step()
    run.opt.zero_grad()
    expect(not matches(), "a step changed nothing")
    rank0 = ctx.rank == 0
    set_model_state_dict(run.model, copy.deepcopy(model_state) if rank0 else {}, options=broadcast)
    set_optimizer_state_dict(run.model, run.opt, copy.deepcopy(optim_state) if rank0 else {}, options=broadcast)
    expect(matches(), "state loaded from rank 0 differs")
    partial = dict(list(model_state.items())[1:]) if rank0 else {}
    expect_raises(RuntimeError, "Missing key", lambda: set_model_state_dict(run.model, partial, options=broadcast))


def dsd_optim_param_group_keys(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    run = build_pair(impl, lambda: nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)), list)
    torch.optim.lr_scheduler.LambdaLR(run.opt, lr_lambda=[lambda epoch: 0.95 ** epoch])
    state = get_optimizer_state_dict(run.model, run.opt,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        expect("initial_lr" in state["param_groups"][0], "the saved group lacks initial_lr")
    opt = adam(run.model.parameters())
    set_optimizer_state_dict(run.model, opt, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if ctx.rank == 0:
        expect("initial_lr" in opt.param_groups[0], "the loaded group lacks initial_lr")


def dsd_flattened_optimizer_state(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    run = build_pair(impl, TinyLM, lambda n: [], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    _train_steps(run, ctx, 0, 1)
    nested = get_optimizer_state_dict(run.model, run.opt)
    flat = get_optimizer_state_dict(run.model, run.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    for state in (flat, nested):
        opt = torch.optim.AdamW(run.model.parameters(), lr=1e-2)
        set_optimizer_state_dict(run.model, opt, state)
        same_state(opt.state_dict(), run.opt.state_dict(), "optimizer")


def dsd_full_into_meta_built_model(impl: Impl, ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))

    with torch.device("meta"):
        net = build()
    model = impl.wrap(net, list(net))
    source = seeded(build)
    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
    check_tensors("loaded parameter", impl.full_params(net), params_of(source), EXACT)


def dcp_save_load(impl: Impl, ctx: Ctx) -> None:
    import torch.distributed.checkpoint as dcp

    run = build_pair(impl, TinyLM, blocks)
    _train_steps(run, ctx, 0, 2)
    where = [tempfile.mkdtemp(prefix="conformance-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(where)
    try:
        dcp.save(run.model.state_dict(), checkpoint_id=where[0])
        net = seeded(TinyLM, seed=123)
        fresh = impl.wrap(net, blocks(net))
        target = fresh.state_dict()
        dcp.load(target, checkpoint_id=where[0])
        fresh.load_state_dict(target)
        loaded = impl.full_params(net)          # a collective: every rank has read the files
    finally:
        if ctx.rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    check_tensors("loaded parameter", loaded, impl.full_params(run.net), EXACT)


# ---- outcomes -----------------------------------------------------------------------------------------

# Errors that say nothing the caller could act on, wherever they are raised.
INTERNAL_ERRORS = {"AssertionError", "AttributeError", "IndexError", "UnboundLocalError", "NameError",
                   "ZeroDivisionError", "RecursionError", "UnitStateError"}


@functools.lru_cache(maxsize=None)
def _implementation_dirs() -> tuple[str, ...]:
    import overlap

    return (os.path.dirname(os.path.abspath(overlap.__file__)) + os.sep,
            os.path.dirname(os.path.abspath(dist.__file__)) + os.sep)


def _is_refusal(exc: BaseException) -> bool:
    """A refusal is raised on purpose by the implementation (a `raise` statement in overlap or in
    torch.distributed); an error from a tensor operation deep inside is a crash."""
    if type(exc).__name__ in INTERNAL_ERRORS or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return filename.startswith(_implementation_dirs()) and line.startswith("raise")


def _first_words(exc: BaseException, words: int = 10) -> str:
    line = (str(exc).strip().splitlines() or [""])[0]
    line = re.sub(r"\brank \d+\b", "rank N", line)          # the same refusal words on every rank
    return " ".join(line.split()[:words])


def _rank_outcome(body: Callable[[Impl, Ctx], None], impl: Impl, ctx: Ctx) -> tuple[str, str]:
    try:
        body(impl, ctx)
        return "pass", ""
    except Mismatch as exc:
        return "fail", str(exc)[:200]
    except Exception as exc:  # noqa: BLE001 - the implementation's answer, classified below
        return "refused" if _is_refusal(exc) else "crashed", f"{type(exc).__name__}: {_first_words(exc)}"


def combine(per_rank: Sequence[tuple[str, str]]) -> str:
    """One outcome from every rank's (kind, detail)."""
    kinds = {kind for kind, _ in per_rank}
    details = [detail for _, detail in per_rank]
    if kinds == {"pass"}:
        return "pass"
    timeouts = [d for d in details if "timed out" in d.lower() or "timeout" in d.lower()]
    if timeouts:
        return f"fail: hang ({timeouts[0]})"
    if kinds == {"refused"} and len(set(details)) == 1:
        return f"refused: {details[0]}"
    if kinds == {"crashed"}:
        return f"fail: crash ({details[0]})" + ("" if len(set(details)) == 1 else " (on rank 0)")
    if kinds == {"fail"}:
        return f"fail: {details[0]}" + ("" if len(set(details)) == 1 else " (on rank 0)")
    return "fail: ranks disagree (" + "; ".join(f"rank {r}: {k} {d}".strip() for r, (k, d) in enumerate(per_rank)) + ")"


# [Note: cases that leave the group broken]
# A case can stop ranks at different points (one rank raises while the others wait in a
# collective), leaving collectives unmatched on the default group: the next case would pair
# its own with them and hang. So the ranks agree on outcomes through a TCPStore of their own,
# not through a process group; a rank whose case did not pass closes its default group at
# once (a rank waiting on it for a collective it will never join gets an error; a group with
# collectives of its own still pending closes only when they time out); and after any outcome
# but "pass", every rank joins a fresh default group. The launch's own group is replaced the
# same way at the first case, with a timeout short enough that a hang costs seconds: the
# cases' collectives are on models of a few thousand parameters.
CASE_TIMEOUT_S = 15
_STORE: list[Any] = []


def _store(ctx: Ctx) -> Any:
    """The store the ranks agree through; made at the first case, over the launch's group."""
    if not _STORE:
        port: list[Any] = [None]
        if ctx.rank == 0:
            with socket.socket() as s:
                s.bind((os.environ.get("MASTER_ADDR", "127.0.0.1"), 0))
                port[0] = s.getsockname()[1]
        dist.broadcast_object_list(port, src=0)
        _STORE.append(dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port[0], ctx.world, ctx.rank == 0,
                                    timeout=datetime.timedelta(seconds=4 * CASE_TIMEOUT_S)))
        _fresh_default_group(ctx, "start")
    return _STORE[0]


def _agree(ctx: Ctx, key: str, mine: Any) -> list[Any]:
    store = _store(ctx)
    store.set(f"{key}/{ctx.rank}", pickle.dumps(mine))
    return [pickle.loads(store.get(f"{key}/{rank}")) for rank in range(ctx.world)]


def _fresh_default_group(ctx: Ctx, key: str) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _mesh.cache_clear()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group/{key}", _STORE[0]), rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S))


def run_case(rank: int, world: int, name: str, impls: Sequence[str]) -> dict[str, str]:
    """Run case `name` under each implementation named in `impls` on this rank; every rank
    returns the same {implementation: outcome}. See [Note: cases that leave the group broken]."""
    ctx = Ctx(rank, world)
    _store(ctx)
    outcomes = {}
    for impl in (impl for impl in IMPLEMENTATIONS if impl.name in impls):
        mine = _rank_outcome(CASES[name].body, impl, ctx)
        if mine[0] != "pass":
            dist.destroy_process_group()
        outcomes[impl.name] = combine(_agree(ctx, f"{name}/{impl.name}", mine))
        if outcomes[impl.name] != "pass":
            _fresh_default_group(ctx, f"{name}/{impl.name}")
    return outcomes


# ---- the registry ---------------------------------------------------------------------------------------

TRAINING = "test_fully_shard_training.py"
FROZEN = "test_fully_shard_frozen.py"
AUTOGRAD = "test_fully_shard_autograd.py"
MIXED = "test_fully_shard_mixed_precision.py"
CLIP = "test_fully_shard_clip_grad_norm_.py"
SCALER = "test_fully_shard_grad_scaler.py"
STATE = "test_fully_shard_state_dict.py"
DSD = "checkpoint/test_state_dict.py"


@dataclass(frozen=True)
class Case:
    name: str
    body: Callable[[Impl, Ctx], None]
    ports: tuple[str, ...]
    what: str
    # Refusals accepted from ShardedModule: the outcome's beginning -> why it is acceptable.
    refusals: dict[str, str] = field(default_factory=dict)

    def accepts(self, outcome: str) -> bool:
        return outcome == "pass" or any(outcome.startswith(prefix) for prefix in self.refusals)


def _case(body: Callable[[Impl, Ctx], None], what: str, *ports: str, refusals: Optional[dict[str, str]] = None) -> Case:
    return Case(body.__name__, body, ports, what, refusals or {})


REGISTRY: list[Case] = [
    _case(root_no_forward_inputs, "a root whose forward takes no inputs trains like one process",
          f"{TRAINING}::test_root_no_forward_inputs"),
    _case(paramless_root_nested_inputs, "a module without parameters takes tensors nested in a tuple",
          f"{TRAINING}::test_root_move_forward_input_to_device"),
    _case(parameters_registered_after_backward, "after forward and after backward, each module attribute is its "
          "registered parameter", f"{TRAINING}::test_param_registration_after_forward",
          f"{TRAINING}::test_param_registration_after_backward"),
    _case(single_group_uneven_shapes, "one group (the root) with shapes no world size divides trains like one process",
          f"{TRAINING}::test_train_parity_single_group_shard_dim0"),
    _case(multi_group_reshard, "blocks as groups, resharded after forward, train like one process",
          f"{TRAINING}::test_train_parity_multi_group", f"{TRAINING}::TestFullyShardWorldSize1 (at 1 rank)"),
    _case(multi_group_keep_gathered, "blocks kept gathered from forward to backward train like one process",
          f"{TRAINING}::test_train_parity_multi_group"),
    _case(cpu_offload, "parameters, gradients and optimizer state offloaded to host memory train like one process",
          f"{TRAINING}::test_train_parity_multi_group_cpu_offload_eager"),
    _case(non_root_forward_backward, "a step through the root, then one through a block called directly",
          f"{TRAINING}::test_non_root_forward_backward"),
    _case(pre_hook_reads_weights, "forward pre-hooks on units read whole, contiguous weights (no_grad forward)",
          f"{TRAINING}::test_shard_placement_fn_contiguous_params_grads"),
    _case(pre_hook_reads_weights_grad_mode, "the same in a training forward",
          f"{TRAINING}::test_shard_placement_fn_contiguous_params_grads"),
    _case(module_called_twice, "a unit called twice in one forward", f"{TRAINING}::test_multi_forward_module"),
    _case(prefetch_two_ahead, "gathering two blocks ahead in forward and backward changes no number",
          f"{TRAINING}::test_explicit_prefetching"),
    _case(activation_checkpointing_utils, "torch.utils.checkpoint around each block",
          f"{TRAINING}::test_train_parity_with_activation_checkpointing"),
    _case(activation_checkpointing_wrapper, "blocks wrapped by apply_activation_checkpointing",
          f"{TRAINING}::test_train_parity_with_activation_checkpointing"),
    _case(activation_checkpointing_composable, "the composable checkpoint() applied to each block",
          f"{TRAINING}::test_train_parity_with_activation_checkpointing"),
    _case(tied_embedding_head, "an embedding tied to the output head",
          f"{TRAINING}::test_train_parity_with_shared_params"),
    _case(chunked_head_outside_forward, "the head called by the caller on chunks after a forward that skipped it",
          f"{TRAINING}::test_partial_group_forward_then_standalone"),
    _case(tied_head_outside_forward, "the same with the head tied to the embedding",
          f"{TRAINING}::test_partial_group_forward_then_standalone"),
    _case(chunked_head_grad_accumulation, "chunked head calls inside microbatches without gradient sync",
          f"{TRAINING}::test_partial_group_forward_grad_accum_chunked"),
    _case(exception_in_forward_recovers, "an exception inside forward, then steps like one process",
          f"{TRAINING}::test_reset_iter_state_after_exception"),
    _case(two_forwards_before_backward, "two forwards (checkpointed blocks) before one backward",
          f"{TRAINING}::test_double_forward_with_nested_fsdp_and_checkpoint"),
    _case(nested_units, "units inside units (mixer and MLP inside each block)",
          f"{TRAINING}::test_double_forward_with_nested_fsdp_and_checkpoint"),
    _case(two_partial_forwards_unused_head, "two forwards that skip the head, one backward: the head has no gradient",
          f"{TRAINING}::test_double_partial_forward_then_backward"),
    _case(tied_uneven_rows_all_updated, "a tied weight with rows no world size divides: every row trains",
          f"{TRAINING}::test_train_shared_params_uneven_shard"),
    _case(tied_across_separate_units, "a weight tied across two wrapped modules: refused at first forward, "
          "or trained like one process", f"{TRAINING}::test_shared_params_separate_fsdp_groups_error"),
    _case(grad_accumulation_no_sync, "microbatches synchronised on the last only, onto zeroed and None grads",
          f"{TRAINING}::test_gradient_accumulation"),
    _case(microbatches_keep_gathered, "microbatches without resharding after forward, synchronised on the last",
          f"{TRAINING}::test_1f1b_microbatching"),
    _case(forward_method_not_forward, "a unit called through a method other than forward",
          f"{TRAINING}::test_register_fsdp_forward_method"),
    _case(frozen_weights_train_biases, "weights frozen before wrapping, biases trained",
          f"{FROZEN}::test_train_mixed_requires_grad_per_group"),
    _case(frozen_weights_with_checkpointing, "the same with each block checkpointed",
          f"{FROZEN}::test_train_mixed_requires_grad_per_group"),
    _case(freeze_after_wrap, "weights frozen after wrapping", f"{FROZEN}::test_train_mixed_requires_grad_per_group"),
    _case(frozen_units_interleaved, "every other unit frozen, a no_grad step between training steps",
          f"{FROZEN}::test_train_mixed_requires_grad_across_groups"),
    _case(unfreeze_after_wrap, "frozen units unfrozen after wrapping for the last step",
          f"{FROZEN}::test_train_mixed_requires_grad_across_groups"),
    _case(frozen_module_called_repeatedly, "frozen and trained units called repeatedly, some calls under no_grad",
          f"{FROZEN}::test_multi_forward_mixed_requires_grad"),
    _case(unused_forward_output, "a forward output left out of the loss on later steps",
          f"{AUTOGRAD}::test_unused_forward_output"),
    _case(unused_forward_module, "a unit never called", f"{AUTOGRAD}::test_unused_forward_module"),
    _case(container_activations, "activations in lists, named tuples, tuples and dicts between units",
          f"{AUTOGRAD}::test_nontensor_activations"),
    _case(dataclass_activations, "activations in dataclasses and nested dataclasses between units",
          f"{MIXED}::test_structured_input_output"),
    _case(namedtuple_activations_mixed_precision, "named-tuple activations under bf16 compute, fp32 reduction",
          f"{MIXED}::test_structured_input_output"),
    _case(post_accumulate_grad_hook_runs_once, "post-accumulate-grad hooks run once per parameter per backward",
          f"{AUTOGRAD}::test_post_acc_grad_hook_runs"),
    _case(optimizer_in_backward_hook, "per-parameter optimizers stepped from post-accumulate-grad hooks",
          f"{AUTOGRAD}::test_post_acc_grad_hook_optim_parity"),
    _case(bf16_compute_bf16_reduce, "bf16 compute and reduction, fp32 master weights and gradients",
          f"{MIXED}::test_compute_dtype"),
    _case(bf16_compute_fp32_reduce, "bf16 compute, fp32 reduction", f"{MIXED}::test_reduce_dtype"),
    _case(fp32_compute_bf16_reduce, "fp32 compute, bf16 reduction", f"{MIXED}::test_reduce_dtype"),
    _case(grad_accumulation_bf16_fp32_reduce, "accumulation without sync under bf16 compute keeps fp32 gradients",
          f"{MIXED}::test_grad_acc_with_reduce_dtype"),
    _case(unit_input_cast, "tensors made inside forward reach each unit in the compute dtype",
          f"{TRAINING}::test_grouped_module_cast_forward_inputs", f"{MIXED}::test_submodules_with_external_inputs"),
    _case(checkpoint_recompute_casts, "a checkpointed unit sees the compute dtype in forward and in recompute",
          f"{MIXED}::test_checkpoint_recompute_casts_forward_inputs"),
    _case(norm_layers_bf16, "a LayerNorm unit between Linear units under bf16 compute",
          f"{MIXED}::test_norm_modules_bf16"),
    _case(cast_after_wrap, "model.to(float64) after wrapping trains in float64",
          f"{TRAINING}::test_to_float64_after_init",
          refusals={"refused: TypeError: ShardedModule": "the parameters are views of flat shards in their dtype: "
                    "converting after wrapping is refused by name on every rank",
                    "refused: TypeError: fully_shard": "the same under fully_shard"}),
    _case(clip_grad_norm_l2, "clip_grad_norm_ (2-norm): one process's total norm and clipped gradients",
          f"{CLIP}::test_clip_grad_norm_1d"),
    _case(clip_grad_norm_l1, "the same with the 1-norm", f"{CLIP}::test_clip_grad_norm_1d"),
    _case(clip_grad_norm_inf, "the same with the infinity norm", f"{CLIP}::test_clip_grad_norm_1d"),
    _case(clip_grad_norm_inf_per_tensor, "the infinity norm without foreach (CPU's default), every part on its own, "
          "empty ones included", f"{CLIP}::test_clip_grad_norm_1d"),
    _case(grad_scaler_finite, "GradScaler: unscale, step and an unchanged scale", f"{SCALER}::test_gradient_scaler"),
    _case(grad_scaler_inf_on_one_rank, "GradScaler: an inf on one rank skips the step everywhere and backs off",
          f"{SCALER}::test_gradient_scaler"),
    _case(state_dict_values_share_parameter_storage, "state_dict(): full-shape DTensors over the parameters' storage",
          f"{STATE}::test_dp_state_dict_save_load"),
    _case(state_dict_load_new_values, "load_state_dict of cloned and refilled state-dict values",
          f"{STATE}::test_dp_state_dict_save_load"),
    _case(state_dict_after_forward_keep_gathered, "state_dict() after a forward that kept blocks gathered",
          f"{STATE}::test_dp_state_dict_save_load"),
    _case(state_dict_tracks_training, "a state dict taken once still holds the weights after steps",
          f"{STATE}::test_cached_state_dict"),
    _case(state_dict_full_tensor_rank0, ".full_tensor() of each state-dict value, kept on rank 0",
          f"{STATE}::test_rank0_offload_full_state_dict"),
    _case(dsd_sharded_roundtrip, "get_state_dict into a fresh model and optimizer; training continues",
          f"{DSD}::test_fsdp2"),
    _case(dsd_strict_keys, "set_model_state_dict refuses unexpected and missing keys unless strict=False",
          f"{DSD}::test_strict"),
    _case(dsd_full_and_cpu_offload, "full_state_dict and cpu_offload options: plain tensors, on rank 0 only",
          f"{DSD}::test_cpu_offload_full_state_dict"),
    _case(dsd_broadcast_from_rank0, "full state dicts equal one process's; set with broadcast_from_rank0",
          f"{DSD}::test_broadcast_from_rank0"),
    _case(dsd_optim_param_group_keys, "param-group keys (initial_lr) survive a full, broadcast optimizer state",
          f"{DSD}::test_optim_state_dict_param_matching"),
    _case(dsd_flattened_optimizer_state, "flattened and nested optimizer state dicts load back",
          f"{DSD}::test_flattened_osd"),
    _case(dsd_full_into_meta_built_model, "a full state dict set into a model built on the meta device",
          f"{DSD}::test_setting_meta_device_model"),
    _case(dcp_save_load, "dcp.save of state_dict(), dcp.load into a fresh model",
          f"{DSD}::test_fsdp2 (its checkpoint load step)"),
]

# FSDP2 tests in the files above not ported, or ported in part, and why.
SKIPPED: list[tuple[str, str]] = [
    (f"{TRAINING}::test_param_registration_after_forward, _after_backward",
     "ported for what any wrapper owes (module attributes are the registered parameters); that they are "
     "DTensors, and FSDPModule.reshard(), are FSDP2's representation and API"),
    (f"{TRAINING}::test_modules_to_run_forward_empty_for_single_module", "FSDP2's private state"),
    (f"{TRAINING}::test_train_parity_single_group_shard_largest_dim, "
     f"{TRAINING}::test_train_parity_shard_placement_fn_shard_largest_dim",
     "shard_placement_fn chooses FSDP2's sharded dimension; ShardedModule's layout has no such choice. "
     "fully_shard takes it: the largest-dimension placement is checked against FSDP2 and one process in "
     "tests/test_fully_shard.py"),
    (f"{TRAINING}::test_train_parity_multi_group (reshard_after_forward=2, delays, compiled)",
     "an int reshard_after_forward at 1 to 3 ranks is True or refused (fully_shard's int, groups of k ranks, is "
     "checked at 4 ranks in tests/test_fully_shard.py; ShardedModule's hpZ takes its groups from "
     "LOCAL_WORLD_SIZE); the delays are accelerator sleep kernels; compiled variants are out of scope"),
    (f"{TRAINING}::test_train_parity_multi_group_unshard_async_op", "a private FSDP2 setter"),
    (f"{TRAINING}::test_post_optim_event, TestFullyShardCudaGraph", "accelerator streams, events and graphs"),
    (f"{TRAINING}::test_train_parity_with_activation_checkpointing (mem_eff groupings)",
     "several modules in one fully_shard call are FSDP2's grouping API; ShardedModule chooses units by class"),
    (f"{TRAINING}::test_partial_group_forward_then_standalone (output_dtype policies)",
     "ShardedModule's MixedPrecision has no output dtype; fully_shard's output_dtype is checked against FSDP2's "
     "in tests/test_fully_shard.py"),
    (f"{TRAINING}::test_partial_group_reshard_toggle",
     "set_reshard_after_forward/_backward and reshard() of one group, checked through FSDP2's private state"),
    (f"{TRAINING}::test_layer_by_layer_shard_no_false_positive",
     "wraps each block as it is built; ShardedModule wraps the finished model in one call"),
    (f"{TRAINING}::test_gradient_accumulation (root_only, some_mlps, reshard_after_backward, HSDP, counts)",
     "per-module sync switches and collective counts are FSDP2's; HSDP needs 4 ranks"),
    (f"{TRAINING}::test_1f1b_microbatching (explicit unshard)", "FSDPModule.unshard() is FSDP2's API"),
    (f"{TRAINING}::TestFullyShardNDTraining, TestFullyShardHSDP3DTraining, TestFullyShardHSDPTraining",
     "tensor, expert and hybrid meshes over 4 to 8 ranks"),
    (f"{TRAINING}::test_share_comm_context", "FSDP2's communication contexts and streams"),
    (f"{FROZEN} (reduce-scatter sizes, post-backward counts)", "checked by patching FSDP2's internals"),
    (f"{MIXED}::test_compute_dtype (float16)", "bf16 only, the low precision CPUs train in"),
    (f"{MIXED}::test_reduce_dtype_after_frozen_first_forward",
     "FSDP2 fails it on CPU here (a bf16 gradient assigned to an fp32 parameter); PyTorch runs it on "
     "accelerators only"),
    (f"{MIXED}::test_no_warmup_jvp_reshard_after_forward_false",
     "forward-mode AD through modules materialised with to_empty after fully_shard: FSDP2's lazy start"),
    (f"{MIXED}::test_float16_on_one_submodule, test_submodules_with_external_inputs (cast off), "
     "test_checkpoint_recompute_casts_outputs",
     "per-module policies: ShardedModule's MixedPrecision is one policy; fully_shard's per-call mp_policy is "
     "checked against FSDP2's with these cases in tests/test_fully_shard.py"),
    (f"{MIXED}::test_norm_modules_bf16 (BatchNorm)",
     "CPU's batch norm refuses bf16 inputs with fp32 running statistics in one process too"),
    (f"{MIXED}::test_clamp_reduce_dtype", "checks the dtype handed to reduce-scatter by patching torch.distributed"),
    (f"{CLIP}::test_clip_grad_norm_2d, {SCALER} (test_2d), "
     f"{STATE}::test_2d_state_dict_correctness, test_dp_tp_state_dict_save_load, test_hsdp_tp_state_dict_save_load",
     "tensor-parallel and hybrid meshes over 4 ranks"),
    (f"{CLIP}::test_clip_grad_norm_1d (all-reduce count)", "collective counts are FSDP2's"),
    (f"{STATE}::test_dp_state_dict_save_load (HSDP, shard_placement_fn)", "hybrid meshes and FSDP2's placements"),
    (f"{STATE}::test_cached_state_dict (moved to another device)", "needs an accelerator"),
    (f"{STATE}::test_dp_state_dict_cpu_offload",
     "builds the pieces from FSDP2's DTensor parameters with distribute_tensor (torch.chunk rows) and pins "
     "memory"),
    (f"{DSD}::test_fsdp2 (compiled, _patch_model_state_dict)", "compiled variants and a private helper"),
    (f"{DSD}::test_setting_meta_device_model_broadcasting_and_memory", "accelerator memory measurements"),
    (f"{DSD}: the FSDP1, DDP, tensor-parallel and one-process tests",
     "not FSDP2 paths (test_fsdp, test_fsdp_ddp, test_ddp, test_shared_weight, test_multi_param_groups, ...)"),
]

CASES: dict[str, Case] = {case.name: case for case in REGISTRY}
# One rank too: there each flat shard is its gathered buffer (`resident`), a path of its own.
WORLDS = (1, 2, 3)
LAUNCH_TIMEOUT_S = 600


def launch_cases(names: Sequence[str], worlds: Sequence[int] = WORLDS,
                 impls: Sequence[str] = tuple(impl.name for impl in IMPLEMENTATIONS)) -> dict[int, Any]:
    """One launch per world size with every case in `names` on it under the implementations
    named in `impls` (tests/distributed.py's [Note: many cases on one launch]), the launches
    run at the same time (most of their time is spent waiting on each other's ranks); returns
    each world size's finished CaseLaunch."""
    import threading

    from distributed import CaseLaunch, RankCase

    runs = {world: CaseLaunch({name: RankCase(run_case, (name, tuple(impls))) for name in names}, world_size=world,
                              timeout=LAUNCH_TIMEOUT_S)
            for world in worlds}
    threads = [threading.Thread(target=run.run_once) for run in runs.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs
