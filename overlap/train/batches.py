"""The job's data: random windows of a byte string, and which batch shards each rank takes.

[Note: batch shards]
A step's global batch is a fixed number of shards of --batch sequences each: the world size
of the run's first start, saved with every checkpoint. At any later world size every rank
takes an equal run of consecutive shards and accumulates their gradients, so a job that
resumes on fewer ranks (a node gone for good) or more trains on the same global batches.
Shard s of step t is the same windows whichever rank takes it."""
from __future__ import annotations

import hashlib

import torch

from overlap.train.options import VAL_FRACTION, JobError


class ByteBatches:
    """Random windows of a byte string, split into train and validation parts.

    The windows of a draw depend only on (seed, shard, split, draw). Training step s takes
    draw s, so a resumed run needs nothing but the step count to go on with the same batches."""

    def __init__(self, text: bytes, seq: int, device: torch.device, seed: int) -> None:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - VAL_FRACTION))
        self.splits = {"train": data[:cut], "val": data[cut:]}
        self.seq = seq
        self.device = device
        self.seed = seed
        self.generator = torch.Generator()

    def get(self, split: str, batch: int, draw: int = 0, shard: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        key = hashlib.blake2b(f"{self.seed}/{shard}/{split}/{draw}".encode(), digest_size=8).digest()
        self.generator.manual_seed(int.from_bytes(key, "little"))
        starts = torch.randint(len(data) - self.seq - 1, (batch,), generator=self.generator)
        window = torch.stack([data[s:s + self.seq + 1] for s in starts.tolist()])
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)


def shards_of_rank(shards: int, rank: int, world: int) -> range:
    """The batch shards rank `rank` of `world` takes each step (see [Note: batch shards])."""
    if shards % world:
        raise JobError(f"the run's global batch is {shards} shards of --batch sequences (its first start had "
                       f"{shards} data-parallel ranks); {world} ranks cannot split it evenly: use a world size "
                       f"(under --pp: world / --pp) that divides {shards}")
    per_rank = shards // world
    return range(rank * per_rank, (rank + 1) * per_rank)
