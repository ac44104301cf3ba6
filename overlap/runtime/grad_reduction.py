"""Gradient reduction over a backward pass: the reduce-scatters issued as units finish their
backward, a bounded number in flight, hybrid sharding's all-reduces across replicas that
follow them, and at the end of backward the wait for all of them and the publishing of
`.grad`."""
from __future__ import annotations

from typing import Optional

import torch

from overlap.base.profiling import phase
from overlap.base.rules import MAX_REDUCES_IN_FLIGHT
from overlap.base.step_record import Mark
from overlap.runtime.collectives import Collectives, Pending
from overlap.runtime.flat_group import FlatGroup
from overlap.runtime.order_check import OrderCheck
from overlap.runtime.unit import Unit


class DirectGradientError(RuntimeError):
    """Raised on every rank when a backward reached the module's own parameters directly."""


class GradReduction:
    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self._reduce_scatters: list[Pending] = []
        # Hybrid sharding: each completed reduce-scatter leaves an all-reduce across replicas
        # in flight (its `follow_up`). On gloo as many again, waited one unit's backward
        # later; on CUDA every one runs on its own stream until the end of backward (see
        # [Note: the all-reduce stream] in overlap.runtime.collectives): waiting sooner
        # would stall the compute stream on the slow link hybrid sharding hides.
        self._all_reduces: list[Pending] = []
        self._bound_all_reduces = not collectives.use_streams

    def reduce(self, unit: Unit, group: FlatGroup, grad: torch.Tensor) -> None:
        """Issue the reduce-scatter of `group`'s full gradient into its shard gradient."""
        target = group.grad_for_reduce()
        self.collectives.log.mark(Mark.REDUCE, unit.name)
        # The group's own collectives: an expert unit's shard over fewer ranks (expert parallelism).
        pending = group.collectives.reduce_scatter(grad, target, group.reduce_dtype, unit.name, group.grad_shard)
        # Offloaded: the sum goes home to the host gradient shard once it is complete.
        group.place.reduction_issued(pending)
        self._reduce_scatters.append(pending)
        self._bound_in_flight(self._reduce_scatters, "wait_reduce_scatter")
        if self._bound_all_reduces:
            self._bound_in_flight(self._all_reduces, "wait_all_reduce")

    def _bound_in_flight(self, queue: list[Pending], label: str) -> None:
        while len(queue) > MAX_REDUCES_IN_FLIGHT:
            pending = queue.pop(0)
            with phase(f"overlap::{label}::{pending.record.unit}"):
                pending.wait()
            if pending.follow_up is not None:
                self._all_reduces.append(pending.follow_up)

    def wait_all(self) -> None:
        with phase("overlap::wait_reduce_scatter::all"):
            while self._reduce_scatters or self._all_reduces:
                pending = (self._reduce_scatters or self._all_reduces).pop(0)
                pending.wait()
                if pending.follow_up is not None:
                    self._all_reduces.append(pending.follow_up)

    def end_backward(self, units: list[Unit], sync_grads: bool, order: Optional[OrderCheck]) -> None:
        """At the end of backward: with `sync_grads`, reduce what no_sync held back and publish
        every gradient; without, only wait for the reductions in flight."""
        if not sync_grads:
            self.wait_all()
            return
        # Gradients held back by no_sync for units that got none this time.
        for unit in units:
            for group in unit.trainable_groups:
                if group.unsynced_grad is not None:
                    self.reduce(unit, group, group.take_grad_for_reduce(None))
        self._publish(units, order)

    def _publish(self, units: list[Unit], order: Optional[OrderCheck]) -> None:
        """Wait for every reduction, then give `.grad` to the parameters that got a gradient
        on any rank. Which ones did is a small all-reduce of flags, issued before the wait so
        that it queues behind the reductions instead of adding its latency to theirs; it
        also carries the check that every rank ran the same units (overlap.runtime.order_check)."""
        groups = [group for unit in units for group in unit.trainable_groups]
        direct = sorted({name for unit in units for group in unit.groups for name in group.direct_grads})
        # The last flag: some rank's backward reached a parameter directly (see [Note: a
        # gradient that reaches a parameter directly] in overlap/runtime/flat_group.py).
        flags = [used for group in groups for used in group.got_grad] + [bool(direct)]
        pending = self.collectives.any_rank(flags, order.words() if order is not None else [])
        self.wait_all()
        flags, maxima, minima = pending()
        if order is not None:
            order.verify(maxima, minima)
        if flags.pop():
            self._refuse_direct(units, direct)
        start = 0
        for group in groups:
            group.publish_grads(flags[start:start + len(group.slots)])
            start += len(group.slots)

    def _refuse_direct(self, units: list[Unit], direct: list[str]) -> None:
        for unit in units:
            for group in unit.groups:
                group.direct_grads.clear()
            for group in unit.trainable_groups:
                group.place.grads_ready()
                group.end_reduction()
        seen = f"here: {', '.join(direct[:5])}" if direct else "on another rank"
        raise DirectGradientError(
            f"a gradient reached the module's own parameters ({seen}), not through its forward: the loss was "
            "computed from model.parameters() (an L2 penalty, say). Under ZeRO-3 each rank's parameters hold only "
            "its rows, so such a term is not the model's; use the optimizer's weight_decay, or compute the term "
            "inside the module's forward. No gradient of this backward was published.")

    def abandon(self, units: list[Unit]) -> None:
        """After a pass that did not finish: wait for its reductions and publish none of them."""
        self.wait_all()
        for unit in units:
            for group in unit.groups:
                group.direct_grads.clear()        # of the pass that did not finish
            for group in unit.trainable_groups:
                group.place.grads_ready()
                group.reduced = False
