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
- `optimizer.state_dict()` is asked for on every rank by torch's state-dict API
  (`get_optimizer_state_dict`), DCP scripts and Lightning's checkpointing, and on rank 0 alone
  by the DDP idiom. It tells the two apart without a collective that could hang: each call
  adds this rank's arrival to a counter in the group's store (torch.distributed's own
  key-value store) and waits, up to a deadline, for the other ranks' arrivals at the same
  call. A lone call finds none and refuses at the call, before any file is opened; ranks
  that all ask pass within milliseconds of each other, since they left the last collective
  together. Its result also refuses to be pickled (`RankPartStateDict`), for a dict asked
  for on every rank and then written by one.
"""
from __future__ import annotations

import copy
import datetime
from collections import OrderedDict
from typing import Any

import torch.distributed as dist

FULL_MODEL = "model.full_state_dict(rank0_only=True)"
FULL_OPTIMIZER = "model.full_optim_state_dict(optimizer, rank0_only=True)"
SHARDED = "overlap.checkpoint.save(path, model, optimizer) (a sharded checkpoint, called on every rank)"


# How long a call waits for the other ranks' arrivals at the same call (see the note): a lone
# call costs this long before it refuses; ranks that all ask are apart by far less.
ARRIVAL_DEADLINE_S = 30.0


class PartialStateError(RuntimeError):
    """A state dict holding this rank's part was about to be written whole."""


def every_rank_asks(group: dist.ProcessGroup, key: str, what: str, full_call: str) -> None:
    """Return once every rank of `group` has made the call numbered `key`; refuse a call no
    other rank makes within the deadline (see the note). `key` must count calls the same way
    on every rank."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    store = group.get_group_store() if hasattr(group, "get_group_store") else dist.distributed_c10d._get_default_store()
    counter = f"overlap/state_dict_arrivals/{key}"
    done = f"{counter}/all"
    if store.add(counter, 1) == world:
        store.set(done, "1")
    try:
        store.wait([done], datetime.timedelta(seconds=ARRIVAL_DEADLINE_S))
    except (dist.DistStoreError, RuntimeError) as error:
        store.add(counter, -1)          # the refused call did not happen: the next one counts as this one
        raise PartialStateError(
            f"{what} was called on rank {dist.get_rank(group)} while the other ranks sharing its state did not "
            f"call it within {ARRIVAL_DEADLINE_S:.0f} s: under ShardedModule it holds this rank's part only, and "
            f"saving it from one rank would write a partial checkpoint. Call {full_call} on every rank and save "
            f"its result on rank 0, or save with {SHARDED}") from error


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
