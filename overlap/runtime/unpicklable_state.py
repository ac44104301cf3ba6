"""State dicts of this rank's part that refuse to be pickled.

[Note: a one-rank save of a sharded state]
A DDP script saves with `torch.save({"model": raw_model.state_dict(), "optimizer":
optimizer.state_dict()}, path)` on rank 0 alone. Under ZeRO-3 both hold this rank's part
only, and nothing at that call can tell that the other ranks are not calling it too: that
would take a collective, which would hang when they are not. So the call itself succeeds
(each parameter a DTensor of its full shape over this rank's rows, each optimizer state
tensor this rank's rows), and what refuses is the one thing that would write a partial
state to a file: pickling it. `torch.save` (and `pickle`) of the returned dict raises an
error naming the calls that do save the whole model; deep copies, `torch.distributed.checkpoint`
and reading the values work as for any dict.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

FULL_MODEL = "model.full_state_dict(rank0_only=True)"
FULL_OPTIMIZER = "model.full_optim_state_dict(optimizer, rank0_only=True)"
SHARDED = "overlap.checkpoint.save(path, model, optimizer) (a sharded checkpoint, called on every rank)"


class PartialStateError(RuntimeError):
    """A state dict holding this rank's part was about to be written whole."""


class RankPartStateDict(OrderedDict):
    """A state dict of this rank's part (see the note); `what` names the call that made it."""

    def __init__(self, items: Any, what: str, full_call: str) -> None:
        super().__init__(items)
        self.what = what
        self.full_call = full_call
        metadata = getattr(items, "_metadata", None)
        if metadata is not None:
            self._metadata = metadata

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise PartialStateError(
            f"{self.what} under ShardedModule holds this rank's part of the state only; saving it with torch.save "
            f"would write a partial checkpoint. Call {self.full_call} on every rank and save its result on rank 0, "
            f"or save with {SHARDED}")

    def __deepcopy__(self, memo: dict) -> "RankPartStateDict":
        return RankPartStateDict([(key, copy.deepcopy(value, memo)) for key, value in self.items()],
                                 self.what, self.full_call)
