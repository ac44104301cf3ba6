"""Two ways to expose a sharded unit's original parameters, timed per step on 2 gloo ranks
(docs/parameters.md): (A) views of whole rows of the runtime's row-aligned flat shard, (B) DTensor
Shard(0) as FSDP2 keeps them (copies into and out of the collectives), and (C) flat shards, for
the optimizer only. Timed for the whole model: the forward parameter path, the gradient path,
and AdamW with foreach=True and foreach=None. Items alternate A, B, C at each repetition after
a barrier; a sample is the slower rank's; B − A is paired per repetition. Memory: parameters,
gradients and optimizer state per rank, padding included.

    python benchmarks/param_layout.py --rounds 5 --reps 10 --out docs/results/param_layout.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from common import (RunRecord, arg_parser, forwarded, launch, markdown_table, median,
                    parse_with_worker_options, quartiles, require_min, script_main, slower_rank, start_rank, to_driver,
                    write_json)

WORLD_SIZE = 2
LAYOUTS = {"A": "row-aligned views", "B": "DTensor Shard(0)", "C": "flat shards"}
OPTIMIZERS = {"adamw_foreach": True, "adamw_default": None}
MIB = 2**20

Timings = dict[str, float]  # part -> seconds of one repetition; "total" is the whole


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _add(parts: Timings, **seconds: float) -> None:
    for part, value in seconds.items():
        parts[part] = parts.get(part, 0.0) + value


def _flat_grad(rank: int, unit_index: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s full gradient of a unit (seeded: every rank can compute every rank's)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + unit_index))


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (DTensors count their local tensor)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class Unit:
    """One unit's original parameters and their place in the flat layout."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.shapes = [p.shape for p in params]
        self.values = [p.detach() for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]


class ViewsUnit:
    """(A): parameters and gradients view the flat shard and its gradient in the runtime's
    row-aligned layout: each parameter is this rank's whole rows, (local_rows, *trailing_dims)."""

    def __init__(self, unit: Unit, rank: int, world: int) -> None:
        from overlap.base.layout import FlatLayout

        self.unit, self.rank, self.world = unit, rank, world
        self.layout = FlatLayout.of(unit.shapes, world)
        self.shard_numel = self.layout.shard_numel
        self.split_sizes = self.layout.split_sizes
        flat = self._laid_out([v.flatten() for v in unit.values])
        start = rank * self.shard_numel
        self.shard = flat[start:start + self.shard_numel].clone()
        self.shard_grad = torch.zeros(self.shard_numel)
        self.full = torch.empty(self.layout.padded_numel)
        self.full_grad = self._laid_out(_flat_grad(rank, unit.index, unit.numel).split(unit.numels))
        # This rank's rows of parameter i: [lo, hi) in its shard.
        self.parts = []
        for index, offset in enumerate(self.layout.offsets):
            first, last = self.layout.part_on(index, rank)
            lo = min(max(offset + first - start, 0), self.shard_numel)
            self.parts.append((lo, lo + last - first))
        shapes = [self.layout.local_shape(i, rank, shape) for i, shape in enumerate(unit.shapes)]
        self.params = [nn.Parameter(self.shard[lo:hi].view(shape)) for (lo, hi), shape in zip(self.parts, shapes)]
        for param, (lo, hi), shape in zip(self.params, self.parts, shapes):
            param.grad = self.shard_grad[lo:hi].view(shape)

    def _laid_out(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel)
        for piece, offset in zip(pieces, self.layout.offsets):
            flat[offset:offset + piece.numel()] = piece.reshape(-1)
        return flat

    def forward(self, parts: Timings) -> list[torch.Tensor]:
        dist.all_gather_into_tensor(self.full, self.shard, async_op=True).wait()
        pieces = torch.split(self.full, self.split_sizes)[::2]
        return [piece.view(shape) for piece, shape in zip(pieces, self.unit.shapes)]

    def reduce_grad(self, parts: Timings) -> None:
        dist.reduce_scatter_tensor(self.shard_grad, self.full_grad)

    def check(self) -> None:
        full = self.forward({})
        _require(all(torch.equal(f, v) for f, v in zip(full, self.unit.values)), "(A) gathered views differ")
        self.reduce_grad({})
        expected = self._laid_out(sum(_flat_grad(r, self.unit.index, self.unit.numel)
                                      for r in range(self.world)).split(self.unit.numels))
        start = self.rank * self.shard_numel
        for param, (lo, hi) in zip(self.params, self.parts):
            _require(param.untyped_storage().data_ptr() == self.shard.untyped_storage().data_ptr(),
                     "(A) a parameter does not alias the flat shard")
            torch.testing.assert_close(param.grad.reshape(-1), expected[start + lo:start + hi])

    def nbytes(self) -> dict[str, int]:
        return dict(params=_storage_bytes([self.shard]), grads=_storage_bytes([self.shard_grad]),
                    gathered=_storage_bytes([self.full]))


class DTensorUnit:
    """(B): each parameter a DTensor sharded on dim 0 over its own padded storage, as FSDP2."""

    def __init__(self, unit: Unit, rank: int, world: int, mesh) -> None:
        self.unit, self.rank, self.world, self.mesh = unit, rank, world, mesh
        self.placements = [Shard(0)]
        self.storages: list[torch.Tensor] = []       # padded local shard, the all-gather input
        self.params: list[nn.Parameter] = []
        self.local_shapes: list[torch.Size] = []
        self.local_strides: list[tuple[int, ...]] = []
        self.padded_numels: list[int] = []            # ceil(dim0/N) rows
        for value in unit.values:
            rows_per_rank = -(-value.shape[0] // world)
            row_numel = value[0].numel()
            rows = min(max(value.shape[0] - rank * rows_per_rank, 0), rows_per_rank)
            storage = torch.zeros(rows_per_rank * row_numel)
            local = storage[:rows * row_numel].view(rows, *value.shape[1:])
            local.copy_(value[rank * rows_per_rank:rank * rows_per_rank + rows])
            reference = distribute_tensor(value, mesh, self.placements).to_local()
            _require(torch.equal(local, reference), "(B) local shard differs from distribute_tensor's")
            dtensor = DTensor.from_local(local, mesh, self.placements, run_check=False, shape=value.shape,
                                         stride=value.stride())
            self.storages.append(storage)
            self.params.append(nn.Parameter(dtensor))
            self.local_shapes.append(local.shape)
            self.local_strides.append(local.stride())
            self.padded_numels.append(rows_per_rank * row_numel)
        send_numel = sum(self.padded_numels)
        # All-gather in place, as FSDP2: this rank's input is its slice of the output.
        self.gather_output = torch.empty(world * send_numel)
        self.send = self.gather_output.narrow(0, rank * send_numel, send_numel)
        self.send_splits = list(torch.split(self.send, self.padded_numels))
        self.unsharded = [torch.empty(world * n) for n in self.padded_numels]  # padded full parameters
        self.unsharded_out = [t.view(world, -1) for t in self.unsharded]
        self.reduce_input = torch.empty(world * send_numel)
        self.reduce_output = torch.empty(send_numel)
        flat = _flat_grad(rank, unit.index, unit.numel)
        self.unsharded_grads = [g.view(shape).clone() for g, shape in zip(flat.split(unit.numels), unit.shapes)]
        self.land_grads()

    def forward(self, parts: Timings) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        torch._foreach_copy_(self.send_splits, self.storages)
        t1 = time.perf_counter()
        dist.all_gather_into_tensor(self.gather_output, self.send, async_op=True).wait()
        t2 = time.perf_counter()
        torch.split_with_sizes_copy(self.gather_output.view(self.world, -1), self.padded_numels, dim=1,
                                    out=self.unsharded_out)
        full = [torch.as_strided(t, shape, value.stride(), 0)
                for t, shape, value in zip(self.unsharded, self.unit.shapes, self.unit.values)]
        _add(parts, copy_in=t1 - t0, copy_out=time.perf_counter() - t2)
        return full

    def reduce_grad(self, parts: Timings) -> None:
        t0 = time.perf_counter()
        torch._chunk_cat(self.unsharded_grads, 0, self.world, out=self.reduce_input.view(self.world, -1))
        t1 = time.perf_counter()
        dist.reduce_scatter_tensor(self.reduce_output, self.reduce_input)
        t2 = time.perf_counter()
        self.land_grads()
        _add(parts, copy_in=t1 - t0, land=time.perf_counter() - t2)

    def land_grads(self) -> None:
        offset = 0
        for param, shape, stride, padded, value in zip(self.params, self.local_shapes, self.local_strides,
                                                       self.padded_numels, self.unit.values):
            local = torch.as_strided(self.reduce_output, shape, stride, offset)
            param.grad = DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=value.shape,
                                            stride=value.stride())
            offset += padded

    def check(self) -> None:
        full = self.forward({})
        _require(all(torch.equal(f, v) for f, v in zip(full, self.unit.values)), "(B) gathered parameters differ")
        self.reduce_grad({})
        expected = sum(_flat_grad(r, self.unit.index, self.unit.numel) for r in range(self.world))
        for param, flat_expected, shape in zip(self.params, expected.split(self.unit.numels), self.unit.shapes):
            rows = -(-shape[0] // self.world)
            torch.testing.assert_close(param.grad.to_local(),
                                       flat_expected.view(shape)[self.rank * rows:(self.rank + 1) * rows])

    def nbytes(self) -> dict[str, int]:
        return dict(params=_storage_bytes(self.storages), grads=_storage_bytes([self.reduce_output]),
                    gathered=_storage_bytes([self.gather_output, *self.unsharded]))


class Model:
    """The benchmark GPT's units in both layouts, and the flat shards as (C)."""

    def __init__(self, rank: int, world: int) -> None:
        from overlap.models import GPT, GPTConfig
        from overlap.base.units import discover_units

        torch.manual_seed(0)
        self.config = GPTConfig()
        model = GPT(self.config)
        root, blocks = discover_units(model, None)
        self.units = [Unit(i, [p for _, p, _ in spec.params]) for i, spec in enumerate([root, *blocks])]
        self.unit_names = [spec.name or "<root>" for spec in [root, *blocks]]
        self.num_params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world,))
        self.views = [ViewsUnit(u, rank, world) for u in self.units]
        self.dtensors = [DTensorUnit(u, rank, world, mesh) for u in self.units]
        flat = []
        for u in self.views:
            param = nn.Parameter(u.shard)
            param.grad = u.shard_grad
            flat.append(param)
        self.params = {"A": [p for u in self.views for p in u.params],
                       "B": [p for u in self.dtensors for p in u.params],
                       "C": flat}
        self.optimizers = {(layout, name): torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=foreach)
                           for layout, params in self.params.items() for name, foreach in OPTIMIZERS.items()}

    def layout_units(self, layout: str) -> list:
        return self.views if layout == "A" else self.dtensors

    def forward(self, layout: str) -> Timings:
        parts: Timings = {}
        for unit in self.layout_units(layout):
            unit.forward(parts)
        return parts

    def reduce_grads(self, layout: str) -> Timings:
        parts: Timings = {}
        for unit in self.layout_units(layout):
            unit.reduce_grad(parts)
        return parts

    def step(self, layout: str, optimizer: str) -> Timings:
        self.optimizers[layout, optimizer].step()
        return {}

    def check(self) -> None:
        """Both layouts gather and reduce correctly; each optimizer updates what it should."""
        for a, b in zip(self.views, self.dtensors):
            a.check()
            b.check()
        for name in OPTIMIZERS:
            before = [u.shard.clone() for u in self.views]
            self.step("A", name)
            for u, old in zip(self.views, before):
                _require(not torch.equal(u.shard, old), "(A) the step did not change the flat shard")
                held = torch.zeros(u.shard_numel, dtype=torch.bool)
                for lo, hi in u.parts:
                    held[lo:hi] = True
                padding = u.shard[~held]
                _require(not padding.any(), "(A) the step wrote the flat shard's padding")
            before = [s.clone() for u in self.dtensors for s in u.storages]
            self.step("B", name)
            after = [s for u in self.dtensors for s in u.storages]
            _require(any(not torch.equal(s, old) for s, old in zip(after, before)), "(B) the step changed nothing")
            state = _optimizer_state(self.optimizers["B", name])
            _require(all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in self.params["B"]),
                     "(B) a parameter or gradient is not a DTensor")
            _require(any(isinstance(v, DTensor) for v in state), "(B) the optimizer state is not DTensor")
            self.step("C", name)

    def memory(self) -> dict[str, dict[str, int]]:
        """Layout -> bytes of params/grads/optimizer state (one AdamW's) on this rank, and the
        largest unit's gathered working set."""
        out = {}
        for layout, units in (("A", self.views), ("B", self.dtensors), ("C", self.views)):
            per_unit = [u.nbytes() for u in units]
            state = _storage_bytes(_optimizer_state(self.optimizers[layout, "adamw_foreach"]))
            out[layout] = dict(params=sum(m["params"] for m in per_unit), grads=sum(m["grads"] for m in per_unit),
                               optimizer_state=state)
            out[layout]["total"] = sum(out[layout].values())
            if layout != "C":
                out[layout]["gathered_largest_unit"] = max(m["gathered"] for m in per_unit)
        return out


ITEMS: dict[str, tuple[tuple[str, ...], Callable[[Model, str], Timings]]] = {
    "forward": (("A", "B"), Model.forward),
    "gradient": (("A", "B"), Model.reduce_grads),
    **{name: (("A", "B", "C"), lambda model, layout, name=name: model.step(layout, name)) for name in OPTIMIZERS},
}


def run_worker(args: argparse.Namespace) -> None:
    rank, world = start_rank()
    model = Model(rank, world)
    model.check()

    def once(item: str, layout: str) -> Timings:
        dist.barrier()
        start = time.perf_counter()
        parts = ITEMS[item][1](model, layout)
        return {**parts, "total": time.perf_counter() - start}

    for item, (layouts, _) in ITEMS.items():  # warm-up, untimed
        for layout in layouts:
            once(item, layout)
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for item, (layouts, _) in ITEMS.items():
            for _ in range(args.reps):
                for layout in layouts:
                    for part, seconds in once(item, layout).items():
                        samples.setdefault(f"{item}/{layout}/{part}", []).append(seconds)
    info = dict(samples=samples, memory=model.memory(),
                tensors={layout: dict(count=len(params), empty=sum(p.numel() == 0 for p in params))
                         for layout, params in model.params.items()})
    config = model.config
    to_driver(args.result, info, num_params=model.num_params,
              model=dict(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
                         vocab_size=config.vocab_size, block_size=config.block_size),
              units={name: u.numel for name, u in zip(model.unit_names, model.units)})


def _stats(samples_ms: list[float]) -> dict:
    q1, q3 = quartiles(samples_ms)
    return dict(median_ms=median(samples_ms), q1_ms=q1, q3_ms=q3, samples_ms=samples_ms)


def summarize(ranks: list[dict]) -> dict[str, dict]:
    """item/layout/part -> median and quartiles (ms) of the slower rank's samples."""
    stats = {key: _stats([t * 1e3 for t in slower_rank(r["samples"][key] for r in ranks)])
             for key in ranks[0]["samples"]}
    # The copies of (B), summed within each repetition before the slower rank is taken.
    for item, parts in (("forward", ("copy_in", "copy_out")), ("gradient", ("copy_in", "land"))):
        per_rank = [[sum(values) for values in zip(*(r["samples"][f"{item}/B/{p}"] for p in parts))] for r in ranks]
        stats[f"{item}/B/copies"] = _stats([t * 1e3 for t in slower_rank(per_rank)])
    # B − A per repetition: the two ran back to back, so slow drifts of a shared host cancel.
    for item in ITEMS:
        a, b = stats[f"{item}/A/total"], stats[f"{item}/B/total"]
        stats[f"{item}/B-A/total"] = _stats([y - x for x, y in zip(a["samples_ms"], b["samples_ms"])])
    return stats


def _cell(stats: dict, key: str, sign: str = "") -> str:
    """'median [q1–q3]' of `key`; `sign` "+" signs each figure (a difference)."""
    if key not in stats:
        return "—"
    s = stats[key]
    return f"{s['median_ms']:{sign}.2f} [{s['q1_ms']:{sign}.2f}–{s['q3_ms']:{sign}.2f}]"


def table(stats: dict, memory: dict) -> str:
    rows = []
    labels = {"forward/{}/total": "forward: all-gather to per-parameter tensors, all units",
              "forward/{}/copy_in": "  (B) copy-in (`_foreach_copy_`)",
              "forward/{}/copy_out": "  (B) copy-out (`split_with_sizes_copy`)",
              "forward/{}/copies": "  (B) copy-in + copy-out",
              "gradient/{}/total": "gradient: reduce-scatter path, all units",
              "gradient/{}/copy_in": "  (B) copy-in (`_chunk_cat`)",
              "gradient/{}/land": "  (B) DTensor gradients from the output",
              "gradient/{}/copies": "  (B) extra over (A)",
              "adamw_foreach/{}/total": "AdamW foreach=True",
              "adamw_default/{}/total": "AdamW foreach=None (per-tensor loop on CPU)"}
    for pattern, label in labels.items():
        rows.append([label, *(_cell(stats, pattern.format(layout)) for layout in LAYOUTS),
                     _cell(stats, pattern.format("B-A"), sign="+")])
    for part in ("params", "grads", "optimizer_state", "total", "gathered_largest_unit"):
        per_layout = [max(m[layout][part] for m in memory) if part in memory[0][layout] else None
                      for layout in LAYOUTS]
        cells = [f"{v / MIB:.2f} MiB" if v is not None else "—" for v in per_layout]
        diff = f"{(per_layout[1] - per_layout[0]) / MIB:+.2f}" if None not in per_layout[:2] else "—"
        rows.append([f"memory per rank: {part.replace('_', ' ')}", *cells, diff])
    headers = ["item (ms per step: median [IQR])", *(f"({k}) {v}" for k, v in LAYOUTS.items()), "B − A (paired per repetition)"]
    return markdown_table(headers, rows)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each runs every item --reps times")
    parser.add_argument("--reps", type=int, default=10, help="repetitions of each item per round (A, B, C alternate)")
    parser.add_argument("--out", default="docs/results/param_layout.json", help="JSON result file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the launch may take")
    args = parse_with_worker_options(parser, argv)
    require_min(parser, args, 1, "rounds", "reps")
    return args


def run_driver(args: argparse.Namespace) -> int:
    record = RunRecord("param_layout.py", args.argv)
    worker = ["--worker", *forwarded(args, ("rounds", "reps"))]
    raw = launch(os.path.abspath(__file__), WORLD_SIZE, worker, args.timeout)
    provenance = record.fields()
    stats = summarize(raw["ranks"])
    memory = [r["memory"] for r in raw["ranks"]]
    host = (f"{os.cpu_count()} cores, 1 thread per rank; 1-min load average {provenance['loadavg_before'][0]:.2f} "
            f"before, {provenance['loadavg_after'][0]:.2f} after (a shared host: other jobs may have run)")
    tensors = raw["ranks"][0]["tensors"]
    counts = ", ".join(f"({k}) {v['count']} ({', '.join(str(r['tensors'][k]['empty']) for r in raw['ranks'])} "
                       f"empty on ranks 0, 1)" for k, v in tensors.items())
    markdown = (f"Command: `{record.command}`\n\nGPT {raw['num_params'] / 1e6:.1f}M parameters, {len(raw['units'])} units, "
                f"gloo, {WORLD_SIZE} ranks, fp32; {args.rounds} rounds × {args.reps} repetitions; {host}.\n"
                f"Tensors the optimizer steps: {counts}.\n\n{table(stats, memory)}")
    write_json(args.out, dict(**provenance, world_size=WORLD_SIZE, rounds=args.rounds, reps=args.reps, host=host,
                              num_params=raw["num_params"], model=raw["model"],
                              units=raw["units"], optimizer_tensors=[r["tensors"] for r in raw["ranks"]],
                              memory_bytes=memory, timings=stats))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))
