"""Training loops written the way scripts for DDP, Hugging Face and torchtitan are written,
each run under DDP and under ShardedModule with its one wrapping line changed.

Every loop takes `wrap(model) -> wrapped` and nothing else differs between the two runs:
the optimizer is built when the original script builds it, gradients are clipped with
torch's own utilities, accumulation uses the wrapper's switches as DDP scripts do. Each
returns per-iteration losses (this rank's micro-batches) and the norms torch's clip returned,
and saves what the script saves.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlap import MixedPrecision, ShardedModule
from overlap.models import GPT, GPTConfig
from overlap.runtime import unpicklable_state

Wrap = Callable[[nn.Module], nn.Module]
CONFIG = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=32)


def ddp(model: nn.Module) -> nn.Module:
    return DDP(model)


def sharded(model: nn.Module) -> nn.Module:
    return ShardedModule(model)


def _batch(iteration: int, micro: int, rank: int, vocab: int, batch: int = 4, seq: int = 16) -> tuple:
    """Counting sequences from random starts: learnable, so the losses move."""
    generator = torch.Generator().manual_seed(1000 * iteration + 10 * micro + rank)
    starts = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (starts + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def nanogpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's `configure_optimizers`: weight decay on parameters of two or more dimensions."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))


def nanogpt_loop(rank: int, wrap: Wrap, out_dir: str, iters: int = 6, accum: int = 2,
                 grad_clip: float = 0.0) -> dict[str, Any]:
    """nanoGPT's train.py, shortened: AdamW groups by `p.dim() >= 2` built from the model
    before wrapping, `require_backward_grad_sync` for accumulation, torch's clip over
    `model.parameters()`, evaluation on every rank, a checkpoint of `raw_model.state_dict()`
    and `optimizer.state_dict()` by rank 0."""
    torch.manual_seed(1337)
    model = GPT(CONFIG)
    optimizer = nanogpt_optimizer(model)
    model = wrap(model)
    raw_model = model.module
    counted = sum(p.numel() for p in model.parameters())
    losses, norms, evals = [], [], []
    for iteration in range(iters):
        for micro in range(accum):
            model.require_backward_grad_sync = micro == accum - 1
            x, y = _batch(iteration, micro, rank, CONFIG.vocab_size)
            loss = model(x, y) / accum
            loss.backward()
            losses.append(loss.item() * accum)
        if grad_clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if iteration % 3 == 2:
            model.eval()
            with torch.no_grad():
                evals.append(model(*_batch(99, 0, rank, CONFIG.vocab_size)).item())
            model.train()
    save_error, kept, optimizer_save_error, optimizer_file_kept = None, None, None, None
    if rank == 0:
        # nanoGPT's save, over a checkpoint an earlier run left there: a refused save must
        # leave that file as it was.
        path = os.path.join(out_dir, f"ckpt_{type(model).__name__}.pt")
        torch.save({"earlier": torch.arange(1000)}, path)
        with open(path, "rb") as f:
            before = f.read()
        try:
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iters}
            torch.save(checkpoint, path)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            save_error = f"{type(exc).__name__}: {exc}"
        with open(path, "rb") as f:
            kept = f.read() == before
        # The optimizer's state alone, saved to its own file over an earlier one.
        optimizer_path = os.path.join(out_dir, f"optim_{type(model).__name__}.pt")
        torch.save({"earlier": torch.arange(1000)}, optimizer_path)
        deadline, unpicklable_state.ARRIVAL_DEADLINE_S = unpicklable_state.ARRIVAL_DEADLINE_S, 2.0  # the wait, shortened
        try:
            torch.save(optimizer.state_dict(), optimizer_path)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            optimizer_save_error = f"{type(exc).__name__}: {exc}"
        finally:
            unpicklable_state.ARRIVAL_DEADLINE_S = deadline
        optimizer_file_kept = torch.load(optimizer_path, weights_only=True).keys() == {"earlier"}
    dist.barrier()
    state = _full_state(model, optimizer, out_dir, rank)
    return {"losses": losses, "norms": norms, "evals": evals, "counted": counted, "save_error": save_error,
            "earlier_file_kept": kept, "optimizer_save_error": optimizer_save_error,
            "optimizer_file_kept": optimizer_file_kept,
            "state": state, "resumed": nanogpt_resume(rank, wrap, state, grad_clip)}


def nanogpt_resume(rank: int, wrap: Wrap, path: str, grad_clip: float, iters: int = 2) -> list[float]:
    """nanoGPT's resume: the checkpoint loaded into the plain model and into its optimizer,
    both before wrapping; then training goes on."""
    checkpoint = torch.load(path, weights_only=True)
    model = GPT(CONFIG)
    model.load_state_dict(checkpoint["model"])
    optimizer = nanogpt_optimizer(model)
    optimizer.load_state_dict(checkpoint["optimizer"])
    model = wrap(model)
    losses = []
    for iteration in range(iters):
        loss = model(*_batch(50 + iteration, 0, rank, CONFIG.vocab_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: str, rank: int) -> str:
    """What the error of a one-rank save asks for: the whole state, gathered on every rank and
    saved by rank 0 (DDP: the module's and the optimizer's own state dicts)."""
    if isinstance(model, ShardedModule):
        state = {"model": model.full_state_dict(rank0_only=True),
                 "optimizer": model.full_optim_state_dict(optimizer, rank0_only=True)}
    else:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    path = os.path.join(out_dir, f"full_{type(model).__name__}.pt")
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    return path


def hf_no_trainer_loop(rank: int, wrap: Wrap, out_dir: str, iters: int = 4, accum: int = 2) -> dict[str, Any]:
    """transformers' `run_clm_no_trainer.py` without accelerate: a GPT-2, AdamW with the
    no-decay names built after wrapping from `named_parameters()`, `get_scheduler`, `no_sync`
    for all micro-batches but the last, torch's clip, `save_pretrained` of the full state."""
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = wrap(model)
    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=5e-3)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=iters)
    losses, norms = [], []
    for iteration in range(iters):
        for micro in range(accum):
            x, _ = _batch(iteration, micro, rank, 101)
            context = model.no_sync() if micro < accum - 1 else _nothing()
            with context:
                loss = model(input_ids=x, labels=x).loss / accum
                loss.backward()
            losses.append(loss.item() * accum)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    state = model.full_state_dict(rank0_only=True) if isinstance(model, ShardedModule) \
        else model.module.state_dict()
    path = os.path.join(out_dir, f"hf_{type(model).__name__}")
    if rank == 0:
        model.module.save_pretrained(path, state_dict=state)
    dist.barrier()
    if isinstance(model, ShardedModule):
        model.save_pretrained(path + "_every_rank")              # the wrapper's own, called on every rank
    return {"losses": losses, "norms": norms, "path": path}


@dataclasses.dataclass
class _Snapshot:
    """minGPT's training snapshot, which its trainer turns into a dict with `asdict`."""

    optimizer_state: dict


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def torchtitan_loop(rank: int, wrap: Wrap, out_dir: str, iters: int = 4) -> dict[str, Any]:
    """torchtitan's train loop, shortened: DCP save of `get_model_state_dict` /
    `get_optimizer_state_dict` halfway, a load into a fresh model and optimizer, torch's
    `clip_grad_norm_` with foreach, then training on from the loaded state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(3)
        model = wrap(GPT(CONFIG))
        return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, foreach=True)

    model, optimizer = build()
    losses, norms = [], []
    path = os.path.join(out_dir, f"dcp_{type(model).__name__}")
    for iteration in range(iters):
        if iteration == iters // 2:
            dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=path)
            model, optimizer = build()
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        loss = model(*_batch(iteration, 0, rank, CONFIG.vocab_size))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3, foreach=True)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "path": path}


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - each case's error is the result
        return ("error", f"{type(exc).__name__}: {exc}")


def edge_cases(rank: int) -> dict[str, Any]:
    """The habits' other shapes, each case's result or error by name."""
    import copy
    import io
    import weakref

    def fresh() -> nn.Module:
        torch.manual_seed(5)
        return GPT(CONFIG)

    def step(model: nn.Module, micro: int = 0) -> None:
        model(*_batch(0, micro, rank, CONFIG.vocab_size)).backward()

    def kept_after_a_weak_reference() -> None:
        plain = fresh()
        held = weakref.ref(plain.wpe.weight)             # as a function compiled before wrapping holds one
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        model = ShardedModule(plain)
        step(model)
        assert held() is not None
        optimizer.step()

    def state_of_another_shape() -> None:
        plain = fresh()
        optimizer = torch.optim.AdamW(plain.parameters())
        optimizer.state[plain.wpe.weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 32),
                                             "exp_avg_sq": torch.zeros(3, 32)}
        model = ShardedModule(plain)
        step(model)
        optimizer.step()

    def switches() -> list[float]:
        """Two micro-batches: set_requires_gradient_sync(False) on the first, as no_sync()."""
        grads = []
        for use_switch in (True, False):
            model = ShardedModule(fresh())
            if use_switch:
                model.set_requires_gradient_sync(False)
                step(model, 0)
                model.set_requires_gradient_sync(True)
            else:
                with model.no_sync():
                    step(model, 0)
            step(model, 1)
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert torch.equal(grads[0], grads[1])
        return [float(grads[0].norm())]

    def grad_norms() -> list[float]:
        model = ShardedModule(fresh())
        step(model)
        return [float(p.grad.norm()) for p in model.parameters()] + \
            [float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type=float("inf")))]

    def grad_norms_ddp() -> list[float]:
        model = DDP(fresh())
        step(model)
        return [float(p.grad.norm()) for p in model.parameters()] + \
            [float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type=float("inf")))]

    def sharded_state() -> dict[str, Any]:
        model = ShardedModule(fresh())
        optimizer = torch.optim.AdamW(model.parameters())
        step(model)
        optimizer.step()
        results = {}
        try:
            model.module.state_dict()
            results["module"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the expected refusal, at the call
            results["module"] = f"{type(exc).__name__}: {exc}"
        optimizer_state = optimizer.state_dict()
        copied = copy.deepcopy(optimizer_state)
        snapshot = dataclasses.asdict(_Snapshot(optimizer_state))      # minGPT's trainer copies its snapshot so
        results["deepcopy"] = sorted(copied) == sorted(optimizer_state)
        for name, value in (("optimizer", optimizer_state), ("snapshot", snapshot)):
            try:
                torch.save(value, io.BytesIO())
                results[name] = "saved"
            except Exception as exc:  # noqa: BLE001 - the expected refusal
                results[name] = f"{type(exc).__name__}: {exc}"
        return results

    def bad_switch() -> None:
        ShardedModule(fresh()).require_backward_grad_sync = "no"

    def clip_in_every_mode() -> dict[str, tuple[float, float]]:
        """torch's total norm beside ShardedModule's own, each sharding, precision, compression
        and offload mode (hybrid and hpZ as two nodes of one rank)."""
        bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        modes = {"full": {}, "bf16": {"mixed_precision": bf16}, "offload_cpu": {"offload": "cpu"},
                 "offload_disk": {"offload": "disk", "mixed_precision": bf16}, "int8": {"compression": "int8"},
                 "int8-int4": {"compression": "int8-int4"}, "hybrid": {"sharding": "hybrid"},
                 "hpz": {"sharding": "hpz"}}
        norms = {}
        local_world = os.environ["LOCAL_WORLD_SIZE"]
        for name, options in modes.items():
            os.environ["LOCAL_WORLD_SIZE"] = "1" if name in ("hybrid", "hpz") else local_world
            try:
                model = ShardedModule(fresh(), **options)
                step(model)
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                theirs = float(torch.nn.utils.get_total_norm(grads))
                norms[name] = (theirs, float(model.clip_grad_norm_(1e9)))
            finally:
                os.environ["LOCAL_WORLD_SIZE"] = local_world
        ddp = DDP(fresh())
        step(ddp)
        norms["ddp"] = (float(torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()])),) * 2
        return norms

    def l2_penalty_in_the_loss() -> dict[str, Any]:
        """An L2 term over `model.parameters()` added to the loss: refused at the backward on
        every rank, in every mode; a step without it trains after."""
        bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out = {}
        local_world = os.environ["LOCAL_WORLD_SIZE"]
        for name, options in (("full", {}), ("offload_cpu_bf16", {"offload": "cpu", "mixed_precision": bf16}),
                              ("int8", {"compression": "int8"}), ("hybrid", {"sharding": "hybrid"})):
            os.environ["LOCAL_WORLD_SIZE"] = "1" if name == "hybrid" else local_world   # two nodes of one rank
            try:
                model = ShardedModule(fresh(), **options)
            finally:
                os.environ["LOCAL_WORLD_SIZE"] = local_world
            loss = model(*_batch(0, 0, rank, CONFIG.vocab_size))
            penalty = sum(p.float().pow(2).sum() for p in model.parameters())
            out[name] = _outcome(lambda: (loss + 1e-3 * penalty).backward())
            model.zero_grad(set_to_none=True)
            step(model)
            out[name + " then"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                                      for p in model.parameters())
        return out

    cases = {"l2_penalty": l2_penalty_in_the_loss, "clip_modes": clip_in_every_mode, "weakref": kept_after_a_weak_reference, "other_shape": state_of_another_shape, "switches": switches,
             "grad_norms": grad_norms, "grad_norms_ddp": grad_norms_ddp, "sharded_state": sharded_state,
             "bad_switch": bad_switch}
    return {name: _outcome(case) for name, case in cases.items()}
