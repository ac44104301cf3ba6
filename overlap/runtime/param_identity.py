"""The module's own `nn.Parameter` objects, kept through wrapping.

[Note: parameters keep their identity]
Code that collected `model.parameters()` before wrapping (the optimizer of a script written
for DDP, an LR scheduler, an EMA, a list of parameters to freeze) holds the module's own
Parameter objects. Each of them is kept: `rebind` swaps the tensor underneath the Python
object (`torch.utils.swap_tensors`) for a view of this rank's flat shard, so the same object
now holds this rank's rows, and an optimizer built before wrapping steps the shard, with
state of the local size. A swap, not `param.data = view`: the swapped object shares the
shard's version counter as every view of it does, which the offload tiers read to tell
whether the master changed (`.data =` keeps the old counter). The object's attributes
(`__dict__`: a framework's marks, `_no_weight_decay`) stay with it.

A swap is refused where something else holds the tensor: a weak reference to the parameter
(a compiled function's guards) or another reference to its C++ tensor. The module then gets a
new Parameter, as it would without this note, and the old one is remembered here: an
optimizer that steps it is refused with the reason (`overlap.runtime.optimizer_state`),
instead of stepping a tensor no computation reads.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# Parameters a swap was refused for -> their name, for the error an optimizer holding one gets.
_left_behind = WeakIdKeyDictionary()   # by identity: tensors compare element-wise


def rebind(param: nn.Parameter, data: torch.Tensor, name: str) -> nn.Parameter:
    """Make `param` hold `data` (a view of a flat shard; see the note) and return it; where the
    swap is refused, a new Parameter over `data` (`param` is remembered as left behind)."""
    new = torch.Tensor._make_subclass(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__)
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError:
        _left_behind[param] = name
        return new
    return param


def left_behind(param: torch.Tensor) -> Optional[str]:
    """The name of the module parameter `param` was before a refused swap, or None."""
    try:
        return _left_behind.get(param)
    except TypeError:                     # not weak-referenceable: not one of ours
        return None
