"""Compiled units (`compile=True`, docs/compile.md) train like one eager process, with each
unit's compute in one graph, no graph break inside it and nothing compiled after the first
step, read from Dynamo's counters on every rank.

Compiling is slow on CPU (tens of seconds per graph when Inductor's cache is cold), so the
cells share one launch per world size, every rank trains on 4 sequences a step whatever the
world size (one input shape for all cells), and the session shares one Inductor cache
(tests/conftest.py). Each cell starts from `torch._dynamo.reset()`, so its counters are its
own and its graphs come from that cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from distributed import run_distributed
from parity import Case, train
from parity_cases import SMALL_GPT, _hf_llama, _hf_loss, _lm_loss
from test_combinations import BF16_TOL, FP32_TOL, CheckpointedGPT
from test_compression import LOSS_RTOL, UPDATE_RTOL

from overlap import MixedPrecision
from overlap.models import GPT

STEPS = 4
ROWS_PER_RANK = 4        # per micro-batch: one input shape in every cell and world size
SEQ = 12


@dataclass(frozen=True)
class Cell:
    name: str
    model: str = "gpt"                       # "gpt", "gpt_checkpointed", "llama"
    route: str = "argument"                  # "argument": compile=True; "blocks": block.compile()
                                             # before wrapping; "whole": torch.compile(ShardedModule)
    wrap: tuple = ()                         # further ShardedModule arguments, as (name, value) pairs
    micro_batches: int = 1
    local_world_size: Optional[int] = None   # hybrid: ranks per node
    meta_init: bool = False                  # built on the meta device

    @property
    def bf16(self) -> bool:
        return "mixed_precision" in dict(self.wrap)

    @property
    def compression(self) -> str:
        return dict(self.wrap).get("compression", "none")


_BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

CELLS: dict[int, list[Cell]] = {
    1: [Cell("plain")],
    2: [Cell("plain"), Cell("checkpointing", model="gpt_checkpointed"), Cell("bf16", wrap=(("mixed_precision", _BF16),)),
        Cell("no_sync", micro_batches=2), Cell("int8", wrap=(("compression", "int8"),)),
        Cell("hybrid", wrap=(("sharding", "hybrid"),), local_world_size=1),
        Cell("blocks_compiled_before_wrapping", route="blocks"), Cell("whole_model_compiled", route="whole"),
        Cell("meta_init", meta_init=True), Cell("llama", model="llama")],
    3: [Cell("plain"), Cell("int8-int4", wrap=(("compression", "int8-int4"),))],
}


def _build(model: str, compile_blocks: bool = False, meta: bool = False) -> nn.Module:
    if model == "llama":
        return _hf_llama()
    model_type = CheckpointedGPT if model == "gpt_checkpointed" else GPT
    with torch.device("meta") if meta else contextlib.nullcontext():
        built = model_type(SMALL_GPT)
    if compile_blocks:
        for block in built.blocks:
            block.compile()                  # torchtitan's recipe, before wrapping
    return built


def _batches(cell: Cell, world: int) -> Callable[[], list[tuple]]:
    vocab = 61 if cell.model == "llama" else SMALL_GPT.vocab_size
    rows = ROWS_PER_RANK * world * cell.micro_batches

    def make() -> list[tuple]:
        gen = torch.Generator().manual_seed(1)
        return [(torch.randint(0, vocab, (rows, SEQ), generator=gen),
                 torch.randint(0, vocab, (rows, SEQ), generator=gen)) for _ in range(STEPS)]
    return make


def case_for(cell: Cell, world: int, sharded: bool) -> Case:
    """The cell's run; unsharded, the eager one-process reference on the same global batches."""
    wrap = {**dict(cell.wrap), "compile": cell.route == "argument"} if sharded else {}
    build = functools.partial(_build, cell.model, sharded and cell.route == "blocks", sharded and cell.meta_init)
    loss = _hf_loss if cell.model == "llama" else _lm_loss
    return Case(cell.name, build, loss, _batches(cell, world), wrap=wrap, micro_batches=cell.micro_batches,
                rewrap=torch.compile if sharded and cell.route == "whole" else None)


def _dynamo_counts() -> dict[str, int]:
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def _train_cells(rank: int, world: int, cells: list[Cell]) -> dict[str, dict[str, Any]]:
    results = {}
    for cell in cells:
        torch._dynamo.reset()
        counters.clear()
        after_warmup: dict[str, int] = {}

        def snapshot(model: nn.Module, step: int) -> None:
            if step == 1:                    # the first step compiles forward and backward
                after_warmup.update(_dynamo_counts())

        if cell.local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(cell.local_world_size)
        try:
            case = dataclasses.replace(case_for(cell, world, sharded=True), before_step=snapshot)
            out = train(case, rank, world, sharded=True)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
        results[cell.name] = {**out, "after_warmup": after_warmup, "at_end": _dynamo_counts()}
    return results


@functools.lru_cache(maxsize=None)
def _sharded(world: int) -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_train_cells, world, CELLS[world], timeout=1500)


@functools.lru_cache(maxsize=None)
def _reference(cell: Cell, world: int) -> dict[str, Any]:
    return train(case_for(cell, world, sharded=False))


def _check_parity(cell: Cell, got: dict[str, Any], ref: dict[str, Any]) -> None:
    losses, ref_losses = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    assert all(math.isfinite(loss) for loss in got["losses"]), got["losses"]
    if cell.compression == "none":
        tol = BF16_TOL if cell.bf16 else FP32_TOL
        assert torch.allclose(losses, ref_losses, **tol), (got["losses"], ref["losses"])
        for key, value in ref["state"].items():
            assert torch.allclose(got["state"][key], value, **tol), key
        return
    assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= LOSS_RTOL[cell.compression]
    initial = _reference_initial(cell)
    delta_ref = torch.cat([(ref["state"][k] - initial[k]).flatten() for k in initial])
    delta = torch.cat([(got["state"][k] - initial[k]).flatten() for k in initial])
    assert float((delta - delta_ref).norm() / delta_ref.norm()) <= UPDATE_RTOL[cell.compression]


def _reference_initial(cell: Cell) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in _build(cell.model).state_dict().items()}


PARAMS = [(world, cell) for world, cells in CELLS.items() for cell in cells]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world,cell", PARAMS, ids=[f"world{w}-{c.name}" for w, c in PARAMS])
def test_compiled_units_train_like_one_eager_process(world: int, cell: Cell) -> None:
    per_rank = [results[cell.name] for results in _sharded(world)]
    _check_parity(cell, per_rank[0], _reference(cell, world))
    for rank, got in enumerate(per_rank):
        warm, end = got["after_warmup"], got["at_end"]
        assert end == warm, f"rank {rank}: compiled again after the first step: {warm} -> {end}"
        assert end["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        if cell.route != "whole":
            # The hooks run eagerly around the compiled forward: nothing breaks a unit's graph.
            assert end["breaks"] == 0, f"rank {rank}: {end['breaks']} graph breaks"
            assert end["frames"] == end["graphs"], f"rank {rank}: a frame compiled in pieces: {end}"
