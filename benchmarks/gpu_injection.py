"""Delays, counts and poison injected into the collectives ShardedModule and FSDP2 issue on one
device: a missing wait between streams, or a buffer freed while a stream still reads it, then
shows as a different or non-finite result.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from common import patched

# torch.cuda._sleep cycles injected around each side-stream collective: ~0.5 ms at ~2 GHz.
SLEEP_CYCLES = 1_000_000


def _collective_functions() -> list[tuple[Any, str, str]]:
    """(owner, attribute, kind) of every function through which ShardedModule and FSDP2 issue a collective."""
    from overlap.runtime import collectives
    from overlap.runtime.collectives import Collectives

    found = [(collectives, "all_gather_flat", "all_gather"), (collectives, "reduce_scatter_flat", "reduce_scatter"),
             # gloo's reduction, and the codec's compressed one on every backend.
             (Collectives, "_all_to_all", "all_to_all")]
    # FSDP2 calls `dist.<name>` at each collective; which name depends on the torch release.
    for name, kind in (("all_gather_into_tensor", "all_gather"), ("all_gather_single", "all_gather"),
                       ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_single", "reduce_scatter")):
        if hasattr(dist, name):
            found.append((dist, name, kind))
    return found


class Injection:
    """While `active()`: every collective is counted by kind with its largest buffer's bytes; on
    CUDA `cycles(kind, nbytes)` of `torch.cuda._sleep` run on its stream before it (and with
    `after`, after it); with `poison` every freed gathered buffer is NaN-filled first."""

    def __init__(self, cycles: Optional[Callable[[str, int], int]] = None, after: bool = False,
                 poison: bool = False, all_reduce: bool = False) -> None:
        self.cycles = cycles
        self.after = after
        self.poison = poison
        # `dist.all_reduce` too (hybrid's across replicas; the step's norm and flags ones as well).
        self.all_reduce = all_reduce
        self.calls: Counter = Counter()
        self.nbytes: Counter = Counter()
        self.slept: Counter = Counter()       # sleep cycles injected, by kind
        self._inside = threading.local()      # one collective reached through another counts once

    def reset(self) -> None:
        self.calls.clear()
        self.nbytes.clear()
        self.slept.clear()

    def _wrap(self, kind: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return fn(*args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            on_cuda = any(t.is_cuda for t in tensors)
            cycles = self.cycles(kind, nbytes) if self.cycles is not None and on_cuda else 0
            self.calls[kind] += 1
            self.nbytes[kind] += nbytes
            self.slept[kind] += cycles * (2 if self.after else 1)
            if cycles:
                torch.cuda._sleep(cycles)
            self._inside.active = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self._inside.active = False
            if cycles and self.after:
                torch.cuda._sleep(cycles)
            return out
        return run

    def _delayed_copies(self, on: Callable) -> Callable:
        """`HostTier.on` with the delay queued first on the copy's stream (downloads, uploads)."""
        def delayed(tier: Any, stream: Optional[torch.cuda.Stream]) -> Any:
            context = on(tier, stream)
            if stream is None or self.cycles is None:
                return context
            cycles = self.cycles("offload_copy", 0)

            @contextlib.contextmanager
            def on_the_stream() -> Iterator[None]:
                with context:
                    self.calls["offload_copy"] += 1
                    self.slept["offload_copy"] += cycles
                    torch.cuda._sleep(cycles)
                    yield
            return on_the_stream()
        return delayed

    @contextlib.contextmanager
    def active(self) -> Iterator["Injection"]:
        from overlap.runtime.flat_group import FlatGroup
        from overlap.runtime.host_tier import HostTier

        targets = _collective_functions() + ([(dist, "all_reduce", "all_reduce")] if self.all_reduce else [])
        free = FlatGroup.free

        def poisoned_free(group: FlatGroup) -> None:
            if group.is_allocated:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(group.full):
                    group.full.detach().fill_(float("nan"))
            free(group)

        with patched(*[(owner, name, self._wrap(kind, getattr(owner, name))) for owner, name, kind in targets],
                     (HostTier, "on", self._delayed_copies(HostTier.on)),
                     (FlatGroup, "free", poisoned_free if self.poison else free)):
            yield self


def race_injection(rehearse: bool) -> Injection:
    """Delays around every collective and before every offload copy (none on CPU), poisoned frees."""
    return Injection(cycles=None if rehearse else (lambda kind, nbytes: SLEEP_CYCLES), after=True, poison=True,
                     all_reduce=True)
