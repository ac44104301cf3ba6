"""A flat buffer's pieces shaped as the parameters they hold: the views a unit's modules
compute with, made before every forward of the unit.

`torch.split` makes every piece in one call (its backward writes all gradients into one flat
tensor); each multi-dimensional parameter's piece then needs a `view` in its shape, one call
per parameter per step from Python. The extension's `param_views` op (csrc/param_views.cpp)
does the split and all the views in one call, so the runtime's calls per step do not grow with
the parameters in a unit. Its dispatch costs about as much as eight Python `view` calls
(measured: 29 against 20 us for a group of one matrix and one vector), and the views themselves
cost the same either way, so the op is used from MIN_VIEWS_FOR_OP shaped parameters on, and
where the extension was not built the loop does it all.
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import torch

from overlap.kernels.ext_backend import param_views_op

MIN_VIEWS_FOR_OP = 4

# (flat, split sizes, dimensions per parameter, all dimensions) -> [first piece, views...]
ViewsOp = Callable[[torch.Tensor, list[int], list[int], list[int]], list[torch.Tensor]]


_op: Optional[ViewsOp] = param_views_op()


class ParamViews:
    """Makes the views of one flat layout: `split_sizes` alternate each parameter's length and
    the padding after it; `shapes` are the parameters' shapes."""

    def __init__(self, split_sizes: Sequence[int], shapes: Sequence[torch.Size], use_op: Optional[bool] = None) -> None:
        # `view`'s arguments: a shape's sizes as separate ints (a torch.Size argument takes torch's
        # slower argument parsing, about 3 us a call against 1.2 us); a 0-d shape as one empty tuple.
        self.reshaped = [(i, tuple(shape) or ((),)) for i, shape in enumerate(shapes) if len(shape) != 1]
        self.ndims = [len(shape) for shape in shapes]
        self.dims = [size for shape in shapes for size in shape]
        # None: the op where it pays and is built.
        self.use_op = _op is not None and len(self.reshaped) >= MIN_VIEWS_FOR_OP if use_op is None else use_op
        # The split leaves out padding of length 0 (each piece it makes is a view with autograd
        # state of its own, about 0.4 us); the op takes the alternating sizes as they are.
        kept = [self.use_op or i % 2 == 0 or size > 0 for i, size in enumerate(split_sizes)]
        self.split_sizes = [size for size, keep in zip(split_sizes, kept) if keep]
        # Where each parameter's piece is among the split's outputs (its node's gradients come
        # in this order).
        position = list(itertools.accumulate(kept))
        self.param_pieces = [position[i] - 1 for i in range(0, len(kept), 2)]

    def __call__(self, flat: torch.Tensor) -> tuple[Optional[torch.autograd.graph.Node], list[torch.Tensor]]:
        """The split's autograd node (None without autograd) and each parameter's view."""
        if self.use_op:
            out = _op(flat, self.split_sizes, self.ndims, self.dims)
            return out[0].grad_fn, out[1:]
        pieces = flat.split_with_sizes(self.split_sizes)   # torch.split's Python wrapper costs as much again
        views = [pieces[i] for i in self.param_pieces]     # the parameters, not the padding after them
        for index, shape in self.reshaped:
            views[index] = views[index].view(*shape)
        return pieces[0].grad_fn, views
