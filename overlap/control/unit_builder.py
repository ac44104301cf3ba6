"""The runtime's units built from the discovered ones: consecutive units merged into buckets,
each unit's parameters packed into one flat group per (dtype, trainable), parameters built on
the meta device given values in place, and the state-dict layout (which key is which flat
group's slot) recorded before parameters leave their modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, NamedTuple, Optional

from torch import nn

from overlap.base.units import UnitSpec, merge_into_buckets
from overlap.base.layout import group_by_kind
from overlap.base.mixed_precision import MixedPrecision
from overlap.control.decision import StartupDecision
from overlap.runtime.collectives import Collectives
from overlap.runtime.expert_parallel import ExpertGroups
from overlap.runtime.flat_group import FlatGroup
from overlap.runtime.host_tier import HostTier
from overlap.runtime.materialize import check_same_values, materialize, meta_places
from overlap.runtime.optimizer_link import OptimizerLink
from overlap.runtime.tensor_parallel import TensorParallel
from overlap.runtime.unit import Unit

# State-dict key -> (flat group, slot index) for a parameter, None for buffers and extra state.
StateDictLayout = list[tuple[str, Optional[tuple[FlatGroup, int]]]]


class ExpertUnits(NamedTuple):
    """Expert parallelism's units: the expert modules (by id), their collectives (over the
    ranks holding the same experts) and the groups their parameters' state dicts span."""

    collectives: Collectives
    modules: set[int]
    groups: ExpertGroups


@dataclass(frozen=True)
class BuiltUnits:
    root: Optional[Unit]            # parameters outside every unit; None when there are none
    units: list[Unit]
    state_dict_layout: StateDictLayout

    @property
    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root is not None else []) + self.units


class _FlatGroups:
    """Packs units' parameters into flat groups, remembering each parameter's slot."""

    def __init__(self, collectives: Collectives, decision: StartupDecision, host: Optional[HostTier],
                 tensor_parallel: Optional[TensorParallel], dtensor_params: bool,
                 experts: Optional[ExpertUnits], link: OptimizerLink, stage: bool,
                 unit_mixed_precision: Optional[Callable[[nn.Module], MixedPrecision]],
                 shard_dims: Mapping[int, int]) -> None:
        self.collectives = collectives
        self.shard_dims = shard_dims
        self.stage = stage
        self.link = link
        self.experts = experts
        self.dtensor_params = dtensor_params
        self.tensor_parallel = tensor_parallel
        self.host = host
        self.mixed_precision = decision.mixed_precision
        self.unit_mixed_precision = unit_mixed_precision
        self.node = decision.sharding.node
        self.slot_of: dict[int, tuple[FlatGroup, int]] = {}

    def unit(self, spec: UnitSpec, modules: list[nn.Module]) -> Unit:
        groups = []
        mixed_precision = self.mixed_precision if self.unit_mixed_precision is None or not modules else \
            self.unit_mixed_precision(modules[0])
        for (dtype, _), entries in group_by_kind(spec.params, lambda entry: entry[1]).items():
            experts = self._experts_of(modules)
            group = FlatGroup(entries, self.collectives if experts is None else experts.collectives,
                              mixed_precision.gather_dtype(dtype),
                              mixed_precision.grad_reduce_dtype(dtype), self.node,
                              None if self.host is None else self.host.place(),
                              None if self.tensor_parallel is None else
                              [self.tensor_parallel.spec_of(param) for _, param, _ in entries],
                              self.dtensor_params, None if experts is None else experts.groups, link=self.link,
                              stage_leaves=self.stage,
                              shard_dims=[self.shard_dims.get(id(param), 0) for _, param, _ in entries])
            for index, (_, param, _) in enumerate(entries):
                self.slot_of[id(param)] = (group, index)
            groups.append(group)
        return Unit(spec.name or "<root>", modules, groups)

    def _experts_of(self, modules: list[nn.Module]) -> Optional[ExpertUnits]:
        """Expert parallelism's units where `modules` are expert modules, else None."""
        if self.experts is not None and modules and all(id(m) in self.experts.modules for m in modules):
            return self.experts
        return None


def build_units(module: nn.Module, root_spec: UnitSpec, unit_specs: list[UnitSpec], collectives: Collectives,
                decision: StartupDecision, param_init_fn: Optional[Callable[[nn.Module], None]], link: OptimizerLink,
                host: Optional[HostTier] = None, tensor_parallel: Optional[TensorParallel] = None,
                merge: bool = True, merge_key: Optional[Callable[[nn.Module], Hashable]] = None,
                dtensor_params: bool = False, initialise_meta: bool = True,
                experts: Optional[ExpertUnits] = None, stage: bool = False,
                unit_mixed_precision: Optional[Callable[[nn.Module], MixedPrecision]] = None,
                shard_dims: Optional[Mapping[int, int]] = None) -> BuiltUnits:
    """Units over `module`'s parameters, which become views of this rank's flat shards (in host
    memory with `host`: offload="cpu"); with `tensor_parallel`, of their TP-local tensors. With
    `merge`, consecutive small units are merged into buckets (only those whose first modules
    give equal `merge_key`s, where given); with `dtensor_params`, the
    modules hold DTensor parameters over those views. Without `initialise_meta`, a meta model's
    parameters start at zero and its meta buffers stay on the meta device (the caller's
    `to_empty()` and initialisation come later). With `experts`, the expert modules' units
    shard over their collectives' group (expert parallelism). With `stage` (a pipeline stage),
    gathered parameters are leaves of their own (FlatGroup's `stage_leaves`). With
    `unit_mixed_precision`, each unit gathers and reduces in the dtypes it gives for the
    unit's first module, the root unit in the decision's. `shard_dims`: parameters sharded on
    another dimension than their first, by id (fully_shard's `shard_placement_fn`)."""
    device = decision.device
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta:
                sub._buffers[name] = buf.to(device)
    on_meta = meta_places(module)
    # State-dict keys in the module's own order, read before parameters leave their modules.
    keys = [(key, id(value)) for key, value in module.state_dict(keep_vars=True).items()]
    flat = _FlatGroups(collectives, decision, host, tensor_parallel, dtensor_params, experts, link, stage,
                       unit_mixed_precision, shard_dims or {})
    root = flat.unit(root_spec, modules=[]) if root_spec.params else None
    specs = merge_into_buckets(unit_specs, decision.bucket_bytes, merge_key) if merge else unit_specs
    units = [flat.unit(spec, spec.modules) for spec in specs]
    if initialise_meta and (on_meta or any(b.is_meta for b in module.buffers())):
        check_same_values(materialize(module, on_meta, flat.slot_of, device, param_init_fn), decision.all_group)
    return BuiltUnits(root, units, [(key, flat.slot_of.get(ident)) for key, ident in keys])
