"""The extension's `param_views` op against the Python loop it replaces (the reference): the
same views of the same memory, and the same gradients through the split, None for the
parameters no gradient reached; on fresh random layouts with padding and odd shapes."""
from __future__ import annotations

import pytest
import torch

from overlap.runtime.param_views import ParamViews

from compiled_extension import compiled_extension, needs_extension  # noqa: F401 - the fixture the mark uses


def _layout(generator: torch.Generator) -> tuple[list[int], list[torch.Size]]:
    shapes, sizes = [], []
    for _ in range(int(torch.randint(1, 9, (), generator=generator))):
        ndim = int(torch.randint(0, 4, (), generator=generator))
        shape = torch.Size(int(d) for d in torch.randint(1, 6, (ndim,), generator=generator))
        shapes.append(shape)
        sizes += [shape.numel(), int(torch.randint(0, 4, (), generator=generator))]
    return sizes, shapes


def _grads(views: ParamViews, flat: torch.Tensor, used: list[bool], weights: list[torch.Tensor]):
    split, made = views(flat)
    seen = []
    split.register_prehook(lambda grads: seen.append([grads[i] is not None for i in views.param_pieces]))
    loss = sum((view * weight).sum() for view, weight, use in zip(made, weights, used) if use)
    loss.backward()
    return made, flat.grad.clone(), seen


@needs_extension
@pytest.mark.parametrize("seed", range(6))
def test_the_op_makes_the_loops_views_and_gradients(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    sizes, shapes = _layout(generator)
    used = [bool(torch.rand((), generator=generator) < 0.7) for _ in shapes] or [True]
    used[0] = True                                     # the loss needs one parameter
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    results = []
    for use_op in (True, False):
        views = ParamViews(sizes, shapes, use_op)
        flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed)).requires_grad_()
        made, grad, seen = _grads(views, flat, used, weights)
        assert [v.shape for v in made] == shapes
        offsets = [sum(sizes[:2 * i]) for i in range(len(shapes))]
        assert [v.data_ptr() for v in made] == [flat.data_ptr() + o * flat.element_size() for o in offsets]
        results.append((grad, seen))
    (op_grad, op_seen), (loop_grad, loop_seen) = results
    assert torch.equal(op_grad, loop_grad) and torch.isfinite(op_grad).all()
    assert op_seen == loop_seen == [used]
