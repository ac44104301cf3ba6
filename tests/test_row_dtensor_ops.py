"""Elementwise operators on `RowDTensor`s (overlap/runtime/row_dtensors.py): an optimizer's
single-tensor steps and a few out-of-place operators give, on rows split unevenly over 2 and 3
gloo ranks (a rank with none among them), torch's values on the whole tensors and on torch's
own DTensors; the path for operands of one spec object ([Note: elementwise operators on one
spec]) gives the same bits as the general path, which compares layouts."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from distributed import run_distributed

# Shapes of odd sizes: a matrix, a vector, a 3-D tensor.
SHAPES = ((7, 5), (7,), (5, 3, 2))
CLOSE = {"rtol": 1e-6, "atol": 1e-6}
LR, MOMENTUM, BETA1, BETA2, EPS, DECAY = 0.01, 0.9, 0.9, 0.999, 1e-8, 0.1

Tensors = dict[str, torch.Tensor]


def _sgd_momentum(t: Tensors) -> None:
    t["m"].mul_(MOMENTUM).add_(t["g"], alpha=1 - MOMENTUM)
    t["p"].add_(t["m"], alpha=-LR)


def _adamw(t: Tensors) -> None:
    """torch.optim.AdamW's single-tensor step, its operators in its order."""
    p, g, m, v = t["p"], t["g"], t["m"], t["v"]
    p.mul_(1 - LR * DECAY)
    m.lerp_(g, 1 - BETA1)
    v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
    denom = (v.sqrt() / 0.9).add_(EPS)      # `/ 0.9`: a wrapped number, served by the general path
    p.addcdiv_(m, denom, value=-LR / 0.5)


def _out_of_place(t: Tensors) -> None:
    p, g, v = t["p"], t["g"], t["v"]
    t["most"] = torch.maximum(v, g)
    t["clamped"] = torch.clamp(p, -0.5, 0.5)
    t["product"] = p * g
    t["double"] = p.to(torch.float64)
    t["copy"] = g.clone().detach()
    v.copy_(g)
    g.zero_()


STEPS: dict[str, Callable[[Tensors], None]] = {
    "sgd": lambda t: t["p"].add_(t["g"], alpha=-LR),
    "sgd-momentum": _sgd_momentum,
    "adamw": _adamw,
    "out-of-place": _out_of_place,
}


def _uneven_rows(rows: int, world: int, generator: torch.Generator) -> list[int]:
    """`rows` cut at random points into `world` blocks; the second rank's is empty at 3 ranks."""
    cuts = sorted(torch.randint(0, rows + 1, (world - 1,), generator=generator).tolist())
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    if world == 3:
        counts = [counts[0] + counts[1], 0, counts[2]]
    return counts


def _compare(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from overlap.runtime import row_dtensors
    from overlap.runtime.row_dtensors import RowDTensor, RowShard, as_dtensor, shard_mesh

    mesh = shard_mesh(dist.group.WORLD, "cpu")
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)        # the same draws on every rank
        for shape in SHAPES:
            rows = _uneven_rows(shape[0], world, generator)
            start = sum(rows[:rank])
            whole = {name: torch.randn(shape, generator=generator) for name in "pgmv"}
            whole["v"] = whole["v"].abs()
            for name, step in STEPS.items():
                plain = {key: value.clone() for key, value in whole.items()}
                torch_dtensors = {key: distribute_tensor(value.clone(), mesh, [Shard(0)])
                                  for key, value in whole.items()}
                parameter = as_dtensor(whole["p"][start:start + rows[rank]].clone(), shape, rows, mesh)
                spec = parameter._spec

                def ours(one_spec: bool) -> Tensors:
                    out = {}
                    for key, value in whole.items():
                        # The parameter's spec object shared, as FlatGroup shares it; or each
                        # tensor its own equal spec, which the one-spec path leaves to the general one.
                        own = spec if one_spec else DTensorSpec(spec.mesh, spec.placements,
                                                                tensor_meta=spec.tensor_meta)
                        out[key] = RowDTensor(value[start:start + rows[rank]].clone(), own, requires_grad=False)
                    return out

                one, general = ours(True), ours(False)
                for tensors in (plain, torch_dtensors, one, general):
                    step(tensors)
                for key in plain:
                    what = f"{name}, {key}, shape {shape}, rows {rows}, seed {seed}"
                    assert isinstance(one[key], RowDTensor), what
                    if one[key].shape == parameter.shape:
                        assert one[key].placements == (RowShard(0, rows),), what
                    torch.testing.assert_close(one[key].to_local(), general[key].to_local(), rtol=0, atol=0,
                                               msg=lambda m: f"{what}: {m}")
                    full = one[key].full_tensor()
                    torch.testing.assert_close(full, plain[key], **CLOSE, msg=lambda m: f"{what}: {m}")
                    torch.testing.assert_close(full, torch_dtensors[key].full_tensor(), **CLOSE,
                                               msg=lambda m: f"{what}: {m}")
            # The one-spec path serves an optimizer's in-place update, returning its operand.
            p = as_dtensor(whole["p"][start:start + rows[rank]].clone(), shape, rows, mesh)
            g = RowDTensor(whole["g"][start:start + rows[rank]].clone(), p._spec, requires_grad=False)
            assert row_dtensors._on_one_spec(torch.ops.aten.add_.Tensor, (p, g), {"alpha": -LR}) is p


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_elementwise_operators_match_torch_on_uneven_rows(world: int) -> None:
    run_distributed(_compare, world, timeout=240)
