"""`overlap.optim.AdamW`: torch.optim.AdamW's interface and results, stepped by the fused CPU
kernel (csrc/adamw_cpu.cpp) wherever it can run.

Param groups, per-group lr / betas / eps / weight decay, `state_dict()` and
`load_state_dict()` are torch's: the state of each parameter is torch's own
(`step` a float32 scalar tensor, `exp_avg`, `exp_avg_sq`), so a state dict of
torch.optim.AdamW loads here and one saved here loads into torch.optim.AdamW, and training
goes on as if it had never changed optimizer. `maximize` is supported; `amsgrad` is refused.

Parameters of a model wrapped with offload="disk" carry a `PagedParam` (overlap.optim.paged):
their fp32 masters and moments live in the model's state file, and they are stepped
together, one segment each, by the pipelined engine there; their state here holds the
`step` count and memory maps of the file for `exp_avg` and `exp_avg_sq`, so state dicts and
checkpoints read and write the file in place. The disk tier steps them during backward with
this optimizer's settings (`next_step_settings`, asked through the model's optimizer link
once the optimizer is linked), and `step()` commits or recomputes those steps ([Note: the speculative step] in
overlap.optim.speculation); the maps then follow each bucket's current slot.

Tensors the kernel does not take (off the CPU, not float32, strided) are stepped by the
torch reference (`overlap.optim.reference`), which is torch.optim.AdamW's single-tensor
step op for op. The kernel rounds every operation as torch's CPU kernels do except the
square root, which it takes correctly rounded where torch's vectorised one is off by an ulp
on a fraction of a percent of elements; the moments match torch's bit for bit and the
parameters to within a few ulps (tests/test_optim_adamw.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple, Union

import torch

from .flat_step import OPTIM_BACKENDS, adamw_step
from .paged import Hyper, PagedAdamW, PagedParam, Segment, paged_of

ParamsT = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


def _check_hyperparameters(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's checks, and plain numbers only (a tensor lr would need a sync per step)."""
    for name, value in (("lr", lr), ("beta1", betas[0]), ("beta2", betas[1]), ("eps", eps),
                        ("weight_decay", weight_decay)):
        if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"overlap.optim.AdamW: {name}={value!r} is invalid; expected a Python number")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _refuse_amsgrad(amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError("overlap.optim.AdamW does not implement amsgrad=True; use torch.optim.AdamW(amsgrad=True)")


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) as torch.optim.AdamW, with the same defaults.

    `backend`: "auto" (the C++ kernel where it can run, the torch reference elsewhere),
    "ext" (the kernel or an error) or "torch" (the reference only).
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, backend: str = "auto") -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        _refuse_amsgrad(amsgrad)
        if backend not in OPTIM_BACKENDS:
            raise ValueError(f"backend={backend!r} is invalid; expected one of {', '.join(OPTIM_BACKENDS)}")
        self.backend = backend
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        _refuse_amsgrad(group.get("amsgrad", False))
        self._register_paged()

    def _register_paged(self) -> None:
        """The group of each parameter by id, kept current through loads, for
        `next_step_settings`. Every parameter, paged or not yet: an optimizer built before
        `ShardedModule(..., offload="disk")` holds the same Parameter objects the wrap pages
        afterwards."""
        self._paged_groups: dict[int, dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._paged_groups[id(p)] = group

    def next_step_settings(self, p: torch.Tensor) -> Optional[Hyper]:
        """The settings `step()` will step `p` with if nothing changes before it: what the
        disk tier asks, through the model's optimizer link, to take the step during backward
        ([Note: the speculative step])."""
        group = self._paged_groups.get(id(p))
        if group is None:
            return None
        state = self.state.get(p)
        return _hyper(group, 1.0 if not state else float(state["step"] + 1))      # float32, as step() counts it

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict comes here: a state dict of torch.optim.AdamW carries its own flags
        # (foreach, fused, ...), which do not concern this optimizer; amsgrad would.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            _refuse_amsgrad(group["amsgrad"])
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)
        self._register_paged()       # the groups are new dicts

    def state_dict(self) -> dict[str, Any]:
        # offload="disk": the moments are maps of the state file, whose last writes may still
        # be in flight behind the step ([Note: reading ahead and writing behind] in
        # overlap.optim.window): flushed first, so the state dict reads the step's values.
        for engine in {id(w.engine): w.engine for g in self.param_groups
                       for w in map(paged_of, g["params"]) if w is not None}.values():
            engine.flush()
        return super().state_dict()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        paged = _PagedSteps()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    if paged_of(p) is not None:
                        paged.settle(paged_of(p))         # a speculation of it is dropped
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("overlap.optim.AdamW does not support sparse gradients")
                state = self.state[p]
                where = paged_of(p)
                if where is not None:
                    # offload="disk": master and moments in the state file; only the step count here.
                    if not state:
                        state["step"] = torch.tensor(0.0, dtype=torch.float32)
                        state.update(paged_moments(p))
                    state["step"] += 1
                    paged.add(p, where, _hyper(group, state["step"].item()))
                    paged.stepped.append(p)
                    continue
                if not state:
                    # As torch: a float32 step count on the CPU, moments shaped like the parameter.
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], betas=group["betas"],
                           eps=group["eps"], weight_decay=group["weight_decay"], step=state["step"].item(),
                           maximize=group["maximize"], backend=self.backend)
        paged.run()
        for p in paged.stepped:
            self.state[p].update(paged_moments(p))      # a commit moves buckets to their other slot
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # offload="disk": torch would cast every loaded state tensor to the parameter's dtype
        # (16-bit here) and hold all of them at once. The moments of paged parameters are kept
        # out of torch's load and written into the state file as saved (fp32), one parameter at
        # a time; a moment that already is the file's memory map (overlap.checkpoint.load
        # reads into those in place) is not copied at all. The state then holds the maps.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        ours = [p for group in self.param_groups for p in group["params"]]
        for engine in {id(w.engine): w.engine for w in map(paged_of, ours) if w is not None}.values():
            engine.abandon()          # a speculation from the state being replaced never commits
            engine.wait_pins()        # an asynchronous save may still read the moments written below
        state = dict(state_dict["state"])
        moments: dict[torch.Tensor, dict[str, Any]] = {}
        for i, p in zip(saved_ids, ours):
            if paged_of(p) is not None and i in state:
                moments[p] = {name: state[i][name] for name in PAGED_MOMENTS}
                state[i] = {key: value for key, value in state[i].items() if key not in PAGED_MOMENTS}
        super().load_state_dict({**state_dict, "state": state})
        for p in ours:
            if paged_of(p) is not None and p not in moments:
                # No saved state: the next step starts its moments at zero, as torch's does.
                for moment in paged_moments(p).values():
                    moment.zero_()
        for p, saved in moments.items():
            maps = paged_moments(p)
            for name, target in maps.items():
                source = saved[name]
                if not _same_memory(source, target):
                    target.copy_(source.reshape(target.shape))
            self.state[p].update(maps)


def _hyper(group: dict[str, Any], step: float) -> Hyper:
    """A paged step's settings: the one `step()` takes and the one the disk tier takes ahead
    of it are made here alike, so that they compare equal when nothing changed."""
    return Hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], step, group["maximize"])


# The state a paged parameter keeps in the state file rather than in memory.
PAGED_MOMENTS = ("exp_avg", "exp_avg_sq")

# The attribute that holds a paged parameter's moment maps once made; it lives and dies with
# the parameter, as the optimizer state that holds the same maps does.
_MAPS_ATTR = "_overlap_moment_maps"


def paged_moments(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """exp_avg and exp_avg_sq of a paged parameter: memory maps of its range of the state
    file (the current slot of its bucket: [Note: two slots per bucket]), shaped like it, so
    that the optimizer's state (and its state dict, and checkpoints) are the file's values
    without holding them in memory. Made once per parameter and slot: a checkpoint load reads
    into these very tensors, and the optimizer's state is them too."""
    where = paged_of(param)
    if where is None:
        raise ValueError("paged_moments: the parameter is not paged (offload='disk')")
    by_slot = getattr(param, _MAPS_ATTR, None)
    if by_slot is None:
        by_slot = {}
        setattr(param, _MAPS_ATTR, by_slot)
    # This rank holds none of the parameter's rows: nothing in the file to map (slot None).
    slot = None if where.start == where.stop else where.engine.slot_of(where.shard, where.start, where.stop)
    maps = by_slot.get(slot)
    if maps is None:
        if slot is None:
            maps = {name: torch.zeros(param.shape, dtype=torch.float32) for name in PAGED_MOMENTS}
        else:
            ranges = where.engine.map_range(where.shard, where.start, where.stop)
            assert ranges is not None, "the disk tier sizes its buckets to hold every parameter's part"
            maps = {name: view.view(param.shape) for name, view in zip(PAGED_MOMENTS, ranges[1:])}
        by_slot[slot] = maps
    return maps


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()


class _PagedSteps:
    """The segments of one step that go through each disk-offload engine, stepped together."""

    def __init__(self) -> None:
        self.segments: dict[PagedAdamW, list[Segment]] = {}
        self.shards: dict[PagedAdamW, dict[int, PagedParam]] = {}
        self.stepped: list[torch.Tensor] = []

    def settle(self, where: PagedParam) -> None:
        """`where`'s engine steps in this step even if none of its parameters has a gradient:
        the step settles the speculations of earlier (see [Note: the speculative step])."""
        self.segments.setdefault(where.engine, [])
        self.shards.setdefault(where.engine, {})

    def add(self, param: torch.Tensor, where: PagedParam, hyper: Hyper) -> None:
        grad_shard = where.grad_shard()
        if grad_shard is None:
            raise RuntimeError("offload='disk': a parameter has a .grad but its group reduced no gradient")
        view = grad_shard[where.start:where.stop]
        if param.grad.data_ptr() != view.data_ptr() or param.grad.dtype != view.dtype:
            view.copy_(param.grad.reshape(-1))          # a .grad the user assigned
        self.segments.setdefault(where.engine, []).append(Segment(where.shard, where.start, where.stop, hyper))
        self.shards.setdefault(where.engine, {})[where.shard] = where

    def run(self) -> None:
        for engine, segments in self.segments.items():
            engine.wait_speculation()          # its writes come before this step's
            shards = self.shards[engine]
            grads: list[Optional[torch.Tensor]] = [None] * len(engine.shard_sizes)
            resident: list[Optional[torch.Tensor]] = [None] * len(engine.shard_sizes)
            for index, where in shards.items():
                grads[index], resident[index] = where.grad_shard(), where.resident
                where.before_step()

            def written(bucket, shards=shards) -> None:
                shards[bucket.shard].on_bucket(bucket)
            engine.step(grads, segments, resident, written)
            for where in shards.values():
                where.on_stepped(where.resident)
