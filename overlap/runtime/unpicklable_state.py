"""A one-rank save of a sharded state, refused before any byte is written where it can be.

[Note: a one-rank save of a sharded state]
A DDP script saves with `torch.save({"model": raw_model.state_dict(), "optimizer":
optimizer.state_dict()}, path)` on rank 0 alone (`raw_model = model.module`). Under ZeRO-3
both hold this rank's part only, and nothing at those calls can tell whether the other ranks
call them too: that would take a collective, which would hang when they do not. A refusal
while pickling comes too late: `torch.save` opens, and so truncates, its file before it
pickles anything, and the checkpoint the save was to replace is gone.
- `model.module.state_dict()` therefore refuses at the call (`ShardedModule`'s state-dict
  hook on the module), naming the calls that save the whole model. Code that saves on every
  rank (FSDP2's way, DCP, torch's state-dict API) calls `model.state_dict()`, whose DTensors
  are the sharded form; the module's own state dict is reached only the DDP way.
- `optimizer.state_dict()` cannot refuse at the call: torch's state-dict API
  (`get_optimizer_state_dict`) and DCP scripts call it on every rank. Its result refuses to
  be pickled instead (`RankPartStateDict`); in the DDP idiom the model's state dict is asked
  for first, in the same expression, and refuses before the file is opened.
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
    """A state dict of this rank's part (see the note); `what` names the call that made it.
    The defaults are the optimizer's: copies made by `type(d)(items)` (`dataclasses.asdict`)
    keep refusing."""

    def __init__(self, items: Any = (), what: str = "optimizer.state_dict()", full_call: str = FULL_OPTIMIZER) -> None:
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
