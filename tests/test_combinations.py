"""Every pairing of features trains like one process or is refused at construction.

The factors: sharding × compression × mixed precision × `no_sync` × activation checkpointing ×
meta-device construction × offload. 256 cells are too many launches, so the cells are an all-pairs
covering (every value of any factor meets every value of any other in at least one cell) plus
the whole sharding × compression grid with the other factors at their defaults, all trained
in one launch of 4 ranks that are told they form 2 nodes of 2 (LOCAL_WORLD_SIZE=2), each cell
building its own ShardedModule. Each cell is compared with one process trained on the same
global batches with SGD: within tests/parity.py's tolerances where nothing is quantised,
within tests/test_compression.py's bounds where it is.

`python tests/test_combinations.py` prints the table of docs/combinations.md.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from distributed import run_distributed
from parity import Case, train, token_batches
from parity_cases import SMALL_GPT, _lm_loss
from test_compression import LOSS_RTOL, UPDATE_RTOL

from overlap import MixedPrecision
from overlap.control.compression_auto import CompressionChooser
from overlap.models import GPT

WORLD = 4
LOCAL_WORLD_SIZE = 2
STEPS = 3

# Each factor's values, its default first.
FACTORS: dict[str, tuple[Any, ...]] = {
    "sharding": ("full", "hybrid", "hpz", "auto"),
    "compression": ("none", "int8", "int8-int4", "auto"),
    "precision": ("fp32", "bf16"),
    "no_sync": (False, True),
    "checkpointing": (False, True),
    "meta_init": (False, True),
    "offload": ("none", "cpu"),
}

# Lossless tolerances: fp32 as tests/parity.py's default Case, bf16 gathers as its gpt_bf16.
FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-3}


@dataclass(frozen=True)
class Cell:
    sharding: str
    compression: str
    precision: str
    no_sync: bool
    checkpointing: bool
    meta_init: bool
    offload: str = "none"

    @property
    def label(self) -> str:
        flags = [name for name in ("no_sync", "checkpointing", "meta_init") if getattr(self, name)]
        if self.offload != "none":
            flags.append(f"offload_{self.offload}")
        return "-".join([self.sharding, self.compression, self.precision, *flags])


def all_pairs(factors: dict[str, tuple[Any, ...]]) -> list[Cell]:
    """A greedy all-pairs covering: each new cell starts from the first pair not yet covered
    and fills every other factor with the value that covers the most uncovered pairs."""
    names = list(factors)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    cells = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]),
                                                         factors[p[0][0]].index(p[0][1]),
                                                         factors[p[1][0]].index(p[1][1])))
        chosen = {a: va, b: vb}
        for name in names:
            if name in chosen:
                continue
            chosen[name] = max(factors[name], key=lambda v: sum(
                (tuple(sorted([(name, v), (other, chosen[other])], key=lambda p: names.index(p[0]))))
                in uncovered for other in chosen))
        uncovered -= {((x, chosen[x]), (y, chosen[y])) for x, y in itertools.combinations(names, 2)}
        cells.append(Cell(**chosen))
    return cells


def grid() -> list[Cell]:
    """Every sharding with every compression, the other factors at their defaults."""
    defaults = {name: values[0] for name, values in FACTORS.items()}
    return [Cell(**{**defaults, "sharding": s, "compression": c})
            for s in FACTORS["sharding"] for c in FACTORS["compression"]]


CELLS = list(dict.fromkeys(grid() + all_pairs(FACTORS)))


class CheckpointedGPT(GPT):
    """The test GPT with each block's activations recomputed in backward."""

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        x_BTD = self.wte(idx_BT) + self.wpe(torch.arange(T, device=idx_BT.device))
        for block in self.blocks:
            x_BTD = checkpoint(block, x_BTD, use_reentrant=False)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        return torch.nn.functional.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


def _build(checkpointing: bool, meta_init: bool) -> torch.nn.Module:
    model_type = CheckpointedGPT if checkpointing else GPT
    if not meta_init:
        return model_type(SMALL_GPT)
    with torch.device("meta"):
        return model_type(SMALL_GPT)


def case_for(cell: Cell, sharded: bool = True) -> Case:
    """The cell's training run; unsharded, the one-process reference (fp32, built eagerly)."""
    wrap: dict[str, Any] = {"sharding": cell.sharding, "compression": cell.compression, "offload": cell.offload}
    if cell.precision == "bf16":
        wrap["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    meta_init = cell.meta_init and sharded
    return Case(cell.label, functools.partial(_build, cell.checkpointing, meta_init), _lm_loss,
                token_batches(SMALL_GPT.vocab_size, 12, steps=STEPS), wrap=wrap if sharded else {},
                micro_batches=2 if cell.no_sync else 1)


def _train_cells(rank: int, world: int, cells: list[Cell]) -> dict[Cell, dict]:
    """Each cell's outcome on this rank: its training results, or the error that refused it at
    construction (an error in training fails the launch)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL_WORLD_SIZE)
    results = {}
    for cell in cells:
        constructed = []
        used = {}

        def read(model: Any) -> None:
            codec = model.collectives.codec
            used["compression"] = "none" if codec is None else codec.settings.mode
            choosers = [c for c in model.step_end.controllers if isinstance(c, CompressionChooser)]
            used["chose"] = choosers[0].decided if choosers else None

        # before_step runs first at step 0, after ShardedModule was built: an error before it is
        # the construction's.
        case = dataclasses.replace(case_for(cell), before_step=lambda model, step: constructed.append(step))
        try:
            out = train(case, rank, world, sharded=True, after=read)
        except ValueError as exc:
            if constructed:
                raise
            results[cell] = {"refused": str(exc)}
            continue
        results[cell] = {**out, **used}
    return results


@functools.lru_cache(maxsize=None)
def _sharded_results(cells: tuple[Cell, ...]) -> list[dict[Cell, dict]]:
    return run_distributed(_train_cells, WORLD, list(cells), timeout=540 * max(1, len(cells) // len(CELLS)))


@functools.lru_cache(maxsize=None)
def _reference(no_sync: bool, checkpointing: bool) -> dict:
    cell = Cell("full", "none", "fp32", no_sync, checkpointing, False)
    return train(case_for(cell, sharded=False))


@functools.lru_cache(maxsize=None)
def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in GPT(SMALL_GPT).state_dict().items()}


@dataclass(frozen=True)
class Comparison:
    loss_rel: float          # largest relative difference of a step's loss from one process
    update_rel: float        # |Δ_sharded - Δ_one_process| / |Δ_one_process| over the run
    state_ok: bool           # every parameter within the lossless tolerance (lossless cells)


def compare(cell: Cell, got: dict) -> Comparison:
    ref, initial = _reference(cell.no_sync, cell.checkpointing), _initial_state()
    losses, ref_losses = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    loss_rel = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    delta_ref = torch.cat([(ref["state"][k] - initial[k]).flatten().float() for k in initial])
    delta = torch.cat([(got["state"][k] - initial[k]).flatten().float() for k in initial])
    tol = BF16_TOL if cell.precision == "bf16" else FP32_TOL
    state_ok = all(torch.allclose(got["state"][k], ref["state"][k], **tol) for k in ref["state"])
    state_ok = state_ok and torch.allclose(losses, ref_losses, **tol)
    return Comparison(loss_rel, float((delta - delta_ref).norm() / delta_ref.norm()), state_ok)


def within_bound(used: str, result: Comparison) -> bool:
    """Lossless: losses and weights within tolerance; quantised: test_compression's bounds."""
    if used == "none":
        return result.state_ok
    return result.loss_rel <= LOSS_RTOL[used] and result.update_rel <= UPDATE_RTOL[used]


def bound(cell: Cell, used: str) -> str:
    """The tolerance a cell is held to, in words."""
    if used == "none":
        tol = BF16_TOL if cell.precision == "bf16" else FP32_TOL
        return f"losses, weights rtol {tol['rtol']:g} atol {tol['atol']:g}"
    return f"loss {LOSS_RTOL[used]:g}, update {UPDATE_RTOL[used]:g}"


def test_the_cells_cover_every_pair() -> None:
    names = list(FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in CELLS}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(CELLS) <= 40


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", CELLS, ids=[c.label for c in CELLS])
def test_the_cell_trains_like_one_process(cell: Cell) -> None:
    """No pairing is refused: an error at construction fails its cell. (A pairing that cannot
    work would be refused in overlap/control/settings.py, on every rank, and expected here.)"""
    per_rank = [results[cell] for results in _sharded_results(tuple(CELLS))]
    assert all("refused" not in outcome for outcome in per_rank), per_rank[0].get("refused")
    got = per_rank[0]
    assert all(math.isfinite(loss) for loss in got["losses"]), got["losses"]
    for rank, outcome in enumerate(per_rank[1:], 1):         # replicas and shards agree
        for key, value in got["state"].items():
            assert torch.equal(outcome["state"][key], value), f"rank {rank}: {key}"
    if cell.sharding == "auto":
        # One host told it holds 2 nodes: the planner chose among the three shardings.
        assert got["sharding"].startswith(("full sharding", "hybrid sharding", "hpZ")), got["sharding"]
    result = compare(cell, got)
    if cell.compression == "auto":
        # Decided after step 2 and used in step 3; with no_sync the step of two micro-batches
        # is measured per micro-batch, so the chooser decides there too.
        assert got["chose"] is not None and got["compression"] == got["chose"], got["chose"]
    assert within_bound(got["compression"], result), (bound(cell, got["compression"]), result)


# One cell of each sharding, run again without order words (OVERLAP_ORDER_CHECK=step).
STEP_CELLS = tuple(next(c for c in CELLS if c.sharding == sharding) for sharding in ("full", "hybrid", "hpz"))


@pytest.mark.timeout(400)
def test_without_order_words_the_cells_train_as_with_them() -> None:
    """The order check's per-step mode changes no collective: each sharding trains within its
    cell's bound of one process, and every rank's weights agree."""
    per_rank = run_distributed(_train_cells, WORLD, list(STEP_CELLS), env={"OVERLAP_ORDER_CHECK": "step"},
                               timeout=360)
    for cell in STEP_CELLS:
        got = per_rank[0][cell]
        assert "refused" not in got and all(math.isfinite(loss) for loss in got["losses"]), cell.label
        for outcome in per_rank[1:]:
            assert all(torch.equal(outcome[cell]["state"][k], v) for k, v in got["state"].items()), cell.label
        assert within_bound(got["compression"], compare(cell, got)), (cell.label, bound(cell, got["compression"]))


def table(cells: list[Cell]) -> str:
    """The markdown table of each cell's outcome (docs/combinations.md)."""
    rows = ["| sharding | compression | precision | no_sync | checkpointing | meta init | offload | ran as | "
            "compression used | outcome | max loss rel. diff | update rel. diff | bound |",
            "|" + "---|" * 13]
    results = _sharded_results(tuple(cells))
    for cell in cells:
        got = results[0][cell]
        flags = ["on" if getattr(cell, name) else "off" for name in ("no_sync", "checkpointing", "meta_init")]
        head = f"| {cell.sharding} | {cell.compression} | {cell.precision} | " + " | ".join(flags) + f" | {cell.offload}"
        if "refused" in got:
            rows.append(f"{head} | | | refused: {got['refused']} | | | |")
            continue
        result = compare(cell, got)
        ok = within_bound(got["compression"], result)
        used = got["compression"]
        if cell.compression == "auto":
            used += f" (auto: {got['chose'] or 'undecided'})"
        rows.append(f"{head} | {got['sharding']} | {used} | {'pass' if ok else 'FAIL'} | "
                    f"{result.loss_rel:.2e} | {result.update_rel:.2e} | {bound(cell, got['compression'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    # --all: every one of the matrix's cells, not only the covering ones (about 6 minutes).
    every = [Cell(*values) for values in itertools.product(*FACTORS.values())]
    sys.stdout.write(table(every if "--all" in sys.argv[1:] else CELLS) + "\n")
