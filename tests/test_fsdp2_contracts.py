"""Training contracts that FSDP2 keeps, kept by ShardedModule: freezing after wrapping,
parameters' post-accumulate-grad hooks (optimizer in backward), GradScaler's skipped steps,
hooks registered before wrapping, nested units, a tied head called after the model returns,
dataclass activations, the infinity-norm clip with empty parts, forward methods other than
`forward`, `parameters()` within a pass and after an evaluation (the optimizer's own objects,
so a checkpoint saved then loads back), pre-hooks reading whole weights through
`named_parameters()` in every mode; and dtype conversions after wrapping, refused at the call
on every rank.

Each case trains ShardedModule on each rank's slice of a global batch and a plain copy of the
model (same seed) on the whole batch inside the same rank, and returns both to compare."""
from __future__ import annotations

import dataclasses
import math
import tempfile
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import CaseLaunch, RankCase
from models import Block

D, HIDDEN, VOCAB, SEQ = 8, 12, 11, 4
ROWS = 2                                            # batch rows per rank
TOL = {"rtol": 1e-4, "atol": 1e-5}


# ---- models -------------------------------------------------------------------------------

class Net(nn.Module):
    """Embedding, blocks and a head (tied to the embedding with `tied`); `forward` returns the
    loss, or the hidden states without targets."""

    def __init__(self, n: int = 3, tied: bool = False, block: Callable[[], nn.Module] = lambda: Block(D, HIDDEN)):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if targets is None:
            return x
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class PostNormBlock(nn.Module):
    """Its own parameter (the norm) used after its Linears: with the Linears units of their
    own, merged into one bucket with it, the block's forward outlives theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.tanh(self.up(x))))


@dataclasses.dataclass
class Activation:
    x: torch.Tensor
    gate: torch.Tensor


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)

    def forward(self, a: Any) -> Activation:
        if isinstance(a, torch.Tensor):
            a = Activation(a, torch.ones_like(a))
        return Activation(a.x + torch.tanh(self.mix(a.x)) * a.gate, torch.sigmoid(self.gate(a.x)))


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(3))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        a = self.embed(tokens)
        for block in self.blocks:
            a = block(a)
        return nn.functional.cross_entropy(self.head(a.x * a.gate).flatten(0, 1), targets.flatten())


class ProjectingBlock(Block):
    def project(self, x: torch.Tensor) -> torch.Tensor:
        """A method other than forward that computes with the block's parameters."""
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ProjectingNet(Net):
    def __init__(self) -> None:
        super().__init__(block=lambda: ProjectingBlock(D, HIDDEN))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block.project(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def greedy(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """`generate`-style: the head on the last position, each new token appended."""
        for _ in range(steps):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            tokens = torch.cat([tokens, self.head(x[:, -1]).argmax(-1, keepdim=True)], dim=1)
        return tokens


# ---- one training run of each kind ----------------------------------------------------------

def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=gen),
            torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=gen))


def _mine(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[ROWS * rank:ROWS * (rank + 1)] for t in batch)


def _pair(build: Callable[[], nn.Module], **wrap: Any) -> tuple[nn.Module, Any]:
    from overlap import ShardedModule

    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    return reference, ShardedModule(build(), **{"prefetch_depth": 1, **wrap})     # a set depth: no link probe


def _global_mean(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _states(reference: nn.Module, sharded: Any) -> dict:
    return {"ours": sharded.full_state_dict(),
            "reference": {k: v.detach().clone() for k, v in reference.state_dict().items()}}


def _train(build: Callable[[], nn.Module], wrap: dict, rank: int, world: int, steps: int = 2,
           loss: Callable[[nn.Module, tuple], torch.Tensor] = lambda model, batch: model(*batch),
           optimizer: Callable[[Any], torch.optim.Optimizer] = lambda ps: torch.optim.SGD(ps, lr=0.1),
           before_step: Optional[Callable[[nn.Module, int], None]] = None) -> dict:
    """The reference on whole batches and ShardedModule on this rank's slices, step by step."""
    reference, sharded = _pair(build, **wrap)
    optimizers = [optimizer(reference.parameters()), optimizer(sharded.parameters())]
    losses: dict[str, list[float]] = {"ours": [], "reference": []}
    for step in range(steps):
        batch = _batch(step, world)
        for model, opt, inner, data, key in ((reference, optimizers[0], reference, batch, "reference"),
                                             (sharded, optimizers[1], sharded.module, _mine(batch, rank), "ours")):
            if before_step is not None:
                before_step(inner, step)
            value = loss(model, data)
            value.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(float(value.detach()) if key == "reference" else _global_mean(value))
    return {"losses": losses, **_states(reference, sharded)}


# ---- the cases ------------------------------------------------------------------------------

def _freezing(rank: int, world: int) -> dict:
    """Step 1 freezes block 1 and one weight of block 0 (a group split by requires_grad);
    step 2 unfreezes them and a weight frozen before wrapping (a frozen group that becomes
    trainable). AdamW with weight decay would move any parameter that had a gradient."""

    def build() -> nn.Module:
        net = Net()
        net.blocks[2].up.weight.requires_grad_(False)
        return net

    def watched(net: nn.Module) -> list[nn.Parameter]:
        return [*net.blocks[1].parameters(), net.blocks[0].up.weight, net.blocks[2].up.weight]

    reference, sharded = _pair(build, unit_types=(Block,), bucket_mb=1e-6)
    runs = [(reference, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)),
            (sharded, sharded.module, torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1))]
    losses: dict[str, list[float]] = {"ours": [], "reference": []}
    grads = []
    for step in range(3):
        batch = _batch(step, world)
        for model, inner, opt in runs:
            inner.blocks[1].requires_grad_(step != 1)
            inner.blocks[0].up.weight.requires_grad_(step != 1)
            inner.blocks[2].up.weight.requires_grad_(step == 2)
            loss = model(*(batch if model is reference else _mine(batch, rank)))
            loss.backward()
            if model is sharded:
                grads.append([p.grad is not None for p in watched(inner)])
                losses["ours"].append(_global_mean(loss))
            else:
                losses["reference"].append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
    return {"losses": losses, **_states(reference, sharded), "grads": grads}


def _optimizer_in_backward(rank: int, world: int) -> dict:
    """torchtune's recipe: one AdamW per parameter, stepped from its post-accumulate-grad
    hook; half the hooks registered before wrapping, half after."""
    from overlap import ShardedModule

    fired = {"reference": 0, "ours": 0}

    def attach(params: list[nn.Parameter], key: str = "ours") -> None:
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in params}

        def hook(p: nn.Parameter) -> None:
            fired[key] += 1
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

    torch.manual_seed(0)
    reference = Net()
    attach(list(reference.parameters()), "reference")
    torch.manual_seed(0)
    inner = Net()
    params = list(inner.parameters())
    attach(params[::2])
    sharded = ShardedModule(inner, unit_types=(Block,), prefetch_depth=1)
    attach(params[1::2])
    for step in range(2):
        batch = _batch(step, world)
        reference(*batch).backward()
        sharded(*_mine(batch, rank)).backward()
    return {**_states(reference, sharded), "fired": fired, "params": len(params),
            "grads_left": sum(p.grad is not None for p in sharded.parameters())}


def _grad_scaler(rank: int, world: int) -> dict:
    """The last rank finds an inf in its rows of one gradient at step 1: every rank skips
    the step and halves its scale, as one process with that inf does."""
    reference, sharded = _pair(Net, unit_types=(Block,))
    runs = [(reference, torch.optim.SGD(reference.parameters(), lr=0.1), True),
            (sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), rank == world - 1)]
    scales: dict[str, list[float]] = {"ours": [], "reference": []}
    scalers = {key: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for key in scales}
    for step in range(3):
        batch = _batch(step, world)
        for model, opt, poisons in runs:
            key = "ours" if model is sharded else "reference"
            scaler = scalers[key]
            scaler.scale(model(*(batch if key == "reference" else _mine(batch, rank)))).backward()
            if step == 1 and poisons:
                grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
                grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales[key].append(scaler.get_scale())
    return {**_states(reference, sharded), "scales": scales}


def _hooked(build: Callable[[], Net], grad_mode: bool) -> Callable[[], Net]:
    """Hooks registered on each block before wrapping. Without `grad_mode`, a pre-hook reads
    the weight under no_grad and scales the input by it; with it, the pre-hook adds a term of
    the weight (a gradient flows into it) and a forward hook changes the output."""

    def make() -> Net:
        net = build()
        for block in net.blocks:
            if grad_mode:
                block.register_forward_pre_hook(lambda m, args: (args[0] + 0.1 * m.up.weight.mean(),))
                block.register_forward_hook(lambda m, args, out: out * 0.9 + 0.1 * m.down.bias.sum())
            else:
                def read(m: nn.Module, args: tuple) -> tuple:
                    with torch.no_grad():
                        scale = 1.0 + m.up.weight.abs().mean()
                        m.seen_shapes = getattr(m, "seen_shapes", []) + [tuple(m.up.weight.shape)]
                    return (args[0] * scale,)
                block.register_forward_pre_hook(read)
        return net

    return make


def _pre_hooks_read_gathered(rank: int, world: int) -> dict:
    shapes: list = []

    def record(net: nn.Module, step: int) -> None:
        shapes.extend(getattr(b, "seen_shapes", None) for b in net.blocks)

    out = _train(_hooked(Net, grad_mode=False), {"unit_types": (Block,), "bucket_mb": 1e-6}, rank, world,
                 steps=3, before_step=record)
    return {**out, "shapes": shapes}


def _hooks_in_grad_mode(rank: int, world: int) -> dict:
    return _train(_hooked(Net, grad_mode=True), {"unit_types": (Block,), "bucket_mb": 1e-6}, rank, world, steps=3)


def _nested_units(rank: int, world: int) -> dict:
    """Blocks and their Linears both units, kept apart, and merged into buckets that cut
    across them: (block 0, its up), (its down, block 1), ... (600-byte buckets)."""
    build = lambda: Net(block=PostNormBlock)     # noqa: E731
    merged = _train(build, {"unit_types": (PostNormBlock, nn.Linear), "reshard_after_forward": True,
                            "bucket_mb": 0.0006}, rank, world)
    apart = _train(build, {"unit_types": (PostNormBlock, nn.Linear), "reshard_after_forward": True,
                           "bucket_mb": 1e-6}, rank, world)
    return {"merged": merged, "apart": apart}


def _chunked_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """The model returns hidden states; the loss applies the tied head chunk by chunk."""
    tokens, targets = batch
    hidden = model(tokens)
    head = model.module.head if hasattr(model, "scheduler") else model.head
    total = sum(nn.functional.cross_entropy(head(h).flatten(0, 1), t.flatten(), reduction="sum")
                for h, t in zip(hidden.chunk(2, dim=1), targets.chunk(2, dim=1)))
    return total / targets.numel()


def _tied_head_outside(rank: int, world: int) -> dict:
    out = _train(lambda: Net(tied=True), {"unit_types": (Block,)}, rank, world, loss=_chunked_loss)
    reference, sharded = _pair(lambda: Net(tied=True), unit_types=(Block,))
    batch = _batch(5, world)
    with torch.no_grad():
        out["eval"] = {"reference": float(_chunked_loss(reference, batch)),
                       "ours": _global_mean(_chunked_loss(sharded, _mine(batch, rank)))}
    return out


def _dataclass_activations(rank: int, world: int) -> dict:
    return _train(GatedNet, {"unit_types": (GatedBlock,), "bucket_mb": 1e-6}, rank, world)


def _clip_infinity_norm(rank: int, world: int) -> dict:
    """A one-row head: its gradient's part is empty on every rank but the first."""

    class Narrow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(D, D)
            self.head = nn.Linear(D, 1, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x))).pow(2).mean()

    reference, sharded = _pair(Narrow, unit_types=(nn.Linear,), bucket_mb=1e-6)
    x = torch.randn(ROWS * world, D, generator=torch.Generator().manual_seed(3))
    norms = {}
    for model, key, data in ((reference, "reference", x), (sharded, "ours", x[ROWS * rank:ROWS * (rank + 1)])):
        model(data).backward()
        clip = (lambda m, n, t: m.clip_grad_norm_(n, norm_type=t)) if key == "ours" else \
            (lambda m, n, t: torch.nn.utils.clip_grad_norm_(m.parameters(), n, norm_type=t))
        norms[key] = float(clip(model, 1e-3, math.inf))
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    empty = [tuple(p.grad.shape) for p in sharded.parameters() if p.grad is not None and not p.grad.numel()]
    return {**_states(reference, sharded), "norms": norms, "empty_parts": empty}


def _forward_methods(rank: int, world: int) -> dict:
    """Each block's `project` (the model's forward calls it instead of the block's forward)
    and the model's `greedy` (registered on the wrapper, FSDP2's way)."""
    from overlap import register_fsdp_forward_method

    def build() -> nn.Module:
        return ProjectingNet()

    reference, sharded = _pair(build, unit_types=(ProjectingBlock,), bucket_mb=1e-6)
    for block in sharded.module.blocks:
        register_fsdp_forward_method(block, "project")
    register_fsdp_forward_method(sharded, "greedy")
    register_fsdp_forward_method(nn.Linear(1, 1), "extra_repr")     # not sharded: nothing to do
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, sharded)]
    for step in range(2):
        batch = _batch(step, world)
        for model, opt, data in ((reference, optimizers[0], batch), (sharded, optimizers[1], _mine(batch, rank))):
            model(*data).backward()
            opt.step()
            opt.zero_grad()
    prompt = _batch(7, world)[0]
    with torch.no_grad():
        tokens = {"reference": reference.greedy(prompt, 3), "ours": sharded.greedy(_mine((prompt,), rank)[0], 3)}
    return {**_states(reference, sharded), "tokens": tokens}


def _conversions_refused(rank: int, world: int) -> dict:
    errors = {}
    reference, sharded = _pair(Net, unit_types=(Block,))
    for name, convert in [("to_float64", lambda m: m.to(torch.float64)), ("double", lambda m: m.double()),
                          ("half", lambda m: m.half()), ("to_dtype_kw", lambda m: m.to(dtype=torch.bfloat16))]:
        try:
            convert(sharded)
        except Exception as exc:   # noqa: BLE001 - the error is the outcome checked
            errors[name] = f"{type(exc).__name__}: {exc}"
    sharded.to("cpu")
    sharded.to(torch.device("cpu"), torch.float32)
    sharded.float()
    sharded.eval()
    sharded.train()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, sharded)]
    batch = _batch(0, world)
    for model, opt, data in ((reference, optimizers[0], batch), (sharded, optimizers[1], _mine(batch, rank))):
        model(*data).backward()
        opt.step()
    return {**_states(reference, sharded), "errors": errors}


def _wrapper_parameters(rank: int, world: int) -> dict:
    """Between forward and backward, and after an evaluation forward (the root stays gathered),
    the wrapper's `parameters()` yields the Parameter objects the optimizer holds; a checkpoint
    saved after the evaluation loads back to the values saved."""
    from overlap import checkpoint

    _, sharded = _pair(Net, unit_types=(Block,))
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.1)
    held = [id(p) for p in optimizer.param_groups[0]["params"]]
    seen: dict[str, Any] = {}
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    for step in range(2):
        data = _mine(_batch(step, world), rank)
        loss = sharded(*data)
        seen.setdefault("mid_pass", [id(p) for p in sharded.parameters()] == held)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            sharded(*data)
        seen.setdefault("after_eval", [id(p) for p in sharded.parameters()] == held)
        if step == 0:
            checkpoint.save(path[0], sharded, optimizer)
            seen["saved"] = sharded.full_state_dict()
    checkpoint.load(path[0], sharded, optimizer)
    return {**seen, "loaded": sharded.full_state_dict()}


# Modes a pre-hook's `named_parameters()` reads whole weights in, with what the wrap takes and
# the two-node emulation hybrid and hpZ need (each rank a node of its own).
HOOK_MODES: dict[str, tuple[dict, bool]] = {
    "fp32": ({}, False), "bf16": ({"mixed_precision": torch.bfloat16}, False), "offload-cpu": ({"offload": "cpu"}, False),
    "int8": ({"compression": "int8"}, False), "hybrid": ({"sharding": "hybrid"}, True),
    "hpz": ({"sharding": "hpz"}, True)}


def _named_parameters_in_every_mode(rank: int, world: int) -> dict:
    """Per mode: what a pre-hook registered after wrapping reads through each block's
    `named_parameters()` in a training forward, the whole weights, and whether every module
    attribute is its registered parameter after forward and after backward."""
    import os

    from overlap import MixedPrecision

    out = {}
    local_world = os.environ["LOCAL_WORLD_SIZE"]
    for mode, (wrap, one_rank_nodes) in HOOK_MODES.items():
        if "mixed_precision" in wrap:
            wrap = {**wrap, "mixed_precision": MixedPrecision(param_dtype=wrap["mixed_precision"])}
        os.environ["LOCAL_WORLD_SIZE"] = "1" if one_rank_nodes else local_world
        try:
            _, sharded = _pair(Net, unit_types=(Block,), **wrap)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = local_world
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        read: dict[str, torch.Tensor] = {}
        for index, block in enumerate(sharded.module.blocks):
            def hook(module: nn.Module, args: tuple, index: int = index) -> None:
                for name, p in module.named_parameters():
                    read[f"blocks.{index}.{name}"] = p.detach().float().clone()
            block.register_forward_pre_hook(hook)

        def attributes_registered() -> bool:
            return all(getattr(module, name) is p for module in sharded.module.modules()
                       for name, p in module.named_parameters(recurse=False))

        whole = {k: v for k, v in sharded.full_state_dict().items() if k.startswith("blocks.")}
        loss = sharded(*_mine(_batch(0, world), rank))
        after_forward = attributes_registered()
        loss.backward()
        out[mode] = {"read": read, "whole": whole, "after_forward": after_forward,
                     "after_backward": attributes_registered(), "loss": _global_mean(loss)}
        optimizer.step()
    return out

CASES = {
    "freezing": _freezing,
    "optimizer_in_backward": _optimizer_in_backward,
    "grad_scaler": _grad_scaler,
    "pre_hooks_read_gathered": _pre_hooks_read_gathered,
    "hooks_in_grad_mode": _hooks_in_grad_mode,
    "nested_units": _nested_units,
    "tied_head_outside": _tied_head_outside,
    "dataclass_activations": _dataclass_activations,
    "clip_infinity_norm": _clip_infinity_norm,
    "forward_methods": _forward_methods,
    "conversions_refused": _conversions_refused,
    "wrapper_parameters": _wrapper_parameters,
    "named_parameters_in_every_mode": _named_parameters_in_every_mode,
}
WORLDS = [2, 3]


@pytest.fixture(scope="module")
def launches() -> dict[int, CaseLaunch]:
    """One launch per world size, every case in turn (tests/distributed.py's [Note: many cases
    on one launch])."""
    return {world: CaseLaunch({name: RankCase(fn) for name, fn in CASES.items()}, world_size=world, timeout=150)
            for world in WORLDS}


def _results(launches: dict[int, CaseLaunch], world: int, name: str) -> list[dict]:
    return [outcome.result() for outcome in launches[world][name]]


def _same_state(result: dict) -> None:
    assert list(result["ours"]) == list(result["reference"])
    for key, expected in result["reference"].items():
        torch.testing.assert_close(result["ours"][key], expected, **TOL, msg=lambda m: f"{key}: {m}")


def _same_losses(result: dict) -> None:
    ours, reference = torch.tensor(result["losses"]["ours"]), torch.tensor(result["losses"]["reference"])
    assert torch.isfinite(ours).all(), ours
    torch.testing.assert_close(ours, reference, **TOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_requires_grad_set_after_wrapping_is_followed_each_step(world: int, launches: dict) -> None:
    for result in _results(launches, world, "freezing"):
        _same_losses(result)
        _same_state(result)
        # Per step: block 1's six parameters, block 0's up.weight, block 2's up.weight
        # (frozen before wrapping, trainable from step 2).
        assert result["grads"] == [[True] * 7 + [False], [False] * 8, [True] * 8], result["grads"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_post_accumulate_grad_hooks_step_each_parameter_in_backward(world: int, launches: dict) -> None:
    for result in _results(launches, world, "optimizer_in_backward"):
        assert result["fired"] == {"reference": 2 * result["params"], "ours": 2 * result["params"]}
        assert result["grads_left"] == 0
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_grad_scaler_skips_on_every_rank_when_one_finds_inf(world: int, launches: dict) -> None:
    for result in _results(launches, world, "grad_scaler"):
        assert result["scales"]["ours"] == result["scales"]["reference"] == [1024.0, 512.0, 512.0]
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_pre_hooks_registered_before_wrapping_read_gathered_weights(world: int, launches: dict) -> None:
    for result in _results(launches, world, "pre_hooks_read_gathered"):
        _same_losses(result)
        _same_state(result)
        # Steps 1 and 2 begin with what each block's hook saw in the steps before: whole weights.
        assert [shapes for shapes in result["shapes"] if shapes] and \
            all(set(shapes) == {(HIDDEN, D)} for shapes in result["shapes"] if shapes), result["shapes"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_pre_hooks_read_whole_weights_through_named_parameters_in_every_mode(world: int, launches: dict) -> None:
    """Registered after wrapping, in a training forward: the gathered weights in the compute
    dtype (int8's as its codec decodes them), and the attributes the registered parameters
    after forward and after backward, in every sharding, precision, compression and offload mode."""
    for result in _results(launches, world, "named_parameters_in_every_mode"):
        for mode, seen in result.items():
            assert math.isfinite(seen["loss"]), mode
            assert seen["after_forward"] and seen["after_backward"], mode
            assert list(seen["read"]) == list(seen["whole"]), mode
            # int8: one scale per block of the flat buffer, whose values may be any parameter's:
            # an error of at most half a step of the largest.
            largest = max(float(whole.abs().max()) for whole in seen["whole"].values())
            for name, whole in seen["whole"].items():
                expected = whole.to(torch.bfloat16).float() if mode == "bf16" else whole
                tolerance = {"atol": largest / 254, "rtol": 0} if mode == "int8" else {"atol": 0, "rtol": 0}
                torch.testing.assert_close(seen["read"][name], expected, **tolerance,
                                           msg=lambda m: f"{mode} {name}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_hooks_registered_before_wrapping_in_grad_mode(world: int, launches: dict) -> None:
    for result in _results(launches, world, "hooks_in_grad_mode"):
        _same_losses(result)
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_nested_units_reshard_after_forward(world: int, launches: dict) -> None:
    for result in _results(launches, world, "nested_units"):
        for layout in ("merged", "apart"):
            _same_losses(result[layout])
            _same_state(result[layout])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_tied_head_called_after_the_model_returns(world: int, launches: dict) -> None:
    for result in _results(launches, world, "tied_head_outside"):
        _same_losses(result)
        _same_state(result)
        assert math.isclose(result["eval"]["ours"], result["eval"]["reference"], rel_tol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_dataclass_activations_between_units(world: int, launches: dict) -> None:
    for result in _results(launches, world, "dataclass_activations"):
        _same_losses(result)
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_infinity_norm_clip_with_empty_parts(world: int, launches: dict) -> None:
    results = _results(launches, world, "clip_infinity_norm")
    assert any(result["empty_parts"] for result in results)
    for result in results:
        assert math.isclose(result["norms"]["ours"], result["norms"]["reference"], rel_tol=1e-5)
        assert result["norms"]["ours"] > 1e-3                     # the clip binds
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_registered_forward_methods_gather_their_parameters(world: int, launches: dict) -> None:
    for rank, result in enumerate(_results(launches, world, "forward_methods")):
        _same_state(result)
        torch.testing.assert_close(result["tokens"]["ours"], result["tokens"]["reference"][ROWS * rank:ROWS * (rank + 1)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_dtype_conversions_after_wrapping_are_refused_on_every_rank(world: int, launches: dict) -> None:
    for rank, result in enumerate(_results(launches, world, "conversions_refused")):
        assert sorted(result["errors"]) == ["double", "half", "to_dtype_kw", "to_float64"], result["errors"]
        for error in result["errors"].values():
            assert error.startswith(f"TypeError: ShardedModule (rank {rank} of {world}): changing the parameters' "
                                    "dtype (torch.float32 to "), error
            assert "convert the model before wrapping" in error and "mixed precision" in error, error
        _same_state(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_the_parameters_are_the_optimizers_within_a_pass_and_after_an_evaluation(world: int, launches: dict) -> None:
    for result in _results(launches, world, "wrapper_parameters"):
        assert result["mid_pass"] and result["after_eval"], result
        for key, expected in result["saved"].items():
            torch.testing.assert_close(result["loaded"][key], expected, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
