"""Padding of the row-aligned flat layout per unit (docs/parameters.md): the benchmark GPT at 2 and
8 ranks, Llama-3-8B's decoder layer and embedding/head unit at 8 and 64 ranks (bf16).
Arithmetic only (overlap.plan.layout_padding).

    python benchmarks/layout_padding.py --out docs/results/layout_padding.json
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch

from common import RunRecord, arg_parser, markdown_table, write_json
from gpt_options import BENCHMARK_MODEL


def _benchmark_units() -> list[tuple[str, list[tuple[int, ...]]]]:
    from overlap.base.units import discover_units
    from overlap.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**BENCHMARK_MODEL))
    root, units = discover_units(model, None)
    return [(spec.name or "<root>", [tuple(p.shape) for _, p, _ in spec.params]) for spec in [root, *units]]


def measure() -> dict[str, Any]:
    from overlap.plan.layout_padding import llama_layer_shapes, llama_root_shapes, unit_padding

    rows = []
    for world in (2, 8):
        for name, shapes in _benchmark_units():
            rows.append(("benchmark GPT fp32", world, unit_padding(name, shapes, world, 4)))
    for world in (8, 64):
        rows.append(("Llama-3-8B bf16", world, unit_padding("decoder layer", llama_layer_shapes(), world, 2)))
        rows.append(("Llama-3-8B bf16", world, unit_padding("embedding + head", llama_root_shapes(), world, 2)))
    return {"model": BENCHMARK_MODEL,
            "units": [dict(model=model, world=world, unit=u.name, numel=u.numel, padding_numel=u.padding_numel,
                           plain_padding_numel=u.plain_padding_numel, padding_bytes=u.padding_bytes,
                           extra_bytes=u.extra_bytes, padding_share=u.padding_share) for model, world, u in rows]}


def table(result: dict[str, Any]) -> str:
    return markdown_table(
        ["model", "ranks", "unit", "elements", "padding (bytes)", "of which row alignment", "share"],
        [[r["model"], r["world"], r["unit"], f"{r['numel']:,}", f"{r['padding_bytes']:,}", f"{r['extra_bytes']:,}",
          f"{100 * r['padding_share']:.3f}%"] for r in result["units"]])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--out", default="docs/results/layout_padding.json")
    args = parser.parse_args(argv)
    record = RunRecord("layout_padding.py", sys.argv[1:] if argv is None else argv)
    result = measure()
    write_json(args.out, {**record.fields(), **result})
    print(table(result))


if __name__ == "__main__":
    main()
