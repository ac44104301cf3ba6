"""Which parameters form which unit, and how small units merge into buckets.

Automatic policy (unit_types=None), the same on every rank because it depends on the
module tree alone: every parameter-holding element of an `nn.ModuleList` or `nn.ModuleDict`
(the usual stack of transformer blocks) is a unit, searching from the root down and not inside a unit; a
model with no such list makes each parameter-holding child of the root a unit. Parameters
outside every unit, and parameters shared by modules of different units (tied embeddings),
belong to the root unit.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence, Union

from torch import nn

from overlap.base.rules import bucket_name, bucket_runs

# (qualified name, parameter, every (module, attribute) that holds it)
ParamEntry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]


@dataclass
class UnitSpec:
    name: str
    modules: list[nn.Module]
    params: list[ParamEntry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p, _ in self.params)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


# Containers hold modules and run none of them: their forward hooks never fire, so one is never
# a unit; their elements are (a ModuleDict of blocks is torchtitan's stack, which pipeline
# stages cut by deleting entries).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _elements(container: nn.Module) -> list[nn.Module]:
    """The parameter-holding modules of a container, those inside nested containers too."""
    found: list[nn.Module] = []
    for child in container.children():
        if isinstance(child, _CONTAINERS):
            found.extend(_elements(child))
        elif _has_params(child):
            found.append(child)
    return found


def _auto_unit_modules(root: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                found.extend(_elements(child))
            else:
                visit(child)

    visit(root)
    if not found:
        found = [m for m in root.children() if _has_params(m) and not isinstance(m, _CONTAINERS)]
    return found


def unit_types_tuple(unit_types: Union[type, Sequence[type], None]) -> Optional[tuple[type, ...]]:
    """`unit_types` as a tuple of module classes: None (automatic), one class, or a sequence."""
    if unit_types is None:
        return None
    if isinstance(unit_types, type):
        unit_types = (unit_types,)
    hint = "expected a module class or a sequence of them, e.g. unit_types=(Block,) for `class Block(nn.Module)`"
    if isinstance(unit_types, (str, bytes)) or not hasattr(unit_types, "__iter__"):
        raise TypeError(f"unit_types={unit_types!r} is invalid; {hint}")
    types = tuple(unit_types)
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise TypeError(f"unit_types={unit_types!r} is invalid: {bad[0]!r} is not an nn.Module class; {hint}")
    return types


def discover_units(root: nn.Module, unit_types: Union[type, Sequence[type], None],
                   unit_groups: Optional[Sequence[Sequence[nn.Module]]] = None,
                   ignored: frozenset[int] = frozenset()) -> tuple[UnitSpec, list[UnitSpec]]:
    """Split `root`'s parameters into the root unit and the units, in module order: one unit
    per group of `unit_groups` where given (a group of several modules is one unit, as
    FSDP2's `fully_shard([a, b])`), else by `unit_types`. Parameters whose ids are in
    `ignored` belong to no unit: they stay in their modules as they are (FSDP2's
    `ignored_params`)."""
    types = unit_types_tuple(unit_types)
    # Each unit module -> the first module of its group, which names the unit.
    group_of: dict[int, int] = {}
    if unit_groups is not None:
        group_of = {id(m): id(group[0]) for group in unit_groups for m in group}
        unit_modules = [m for m in root.modules() if id(m) in group_of and m is not root and _has_params(m)]
    elif types is None:
        unit_modules = _auto_unit_modules(root)
    else:
        unit_modules = [m for m in root.modules() if isinstance(m, types) and m is not root and _has_params(m)]
    unit_ids = {id(m) for m in unit_modules}

    root_spec = UnitSpec("", [root])
    specs: dict[int, UnitSpec] = {}
    occurrences: dict[int, list[tuple[str, nn.Module, str, int]]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}

    # `owner` is the id of the innermost unit module above (or at) each module; 0 is the root.
    def walk(module: nn.Module, prefix: str, owner: int) -> None:
        if id(module) in unit_ids:
            owner = group_of.get(id(module), id(module))
            if owner in specs:
                specs[owner].modules.append(module)
            else:
                specs[owner] = UnitSpec(prefix.rstrip("."), [module])
        for attr, param in module._parameters.items():
            if param is not None and id(param) not in ignored:
                occurrences[id(param)].append((prefix + attr, module, attr, owner))
                params[id(param)] = param
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{child_name}.", owner)

    walk(root, "", 0)
    by_owner: dict[int, UnitSpec] = {0: root_spec, **specs}
    for key, places in occurrences.items():
        owners = {owner for *_, owner in places}
        owner = owners.pop() if len(owners) == 1 else 0
        by_owner[owner].params.append((places[0][0], params[key], [(m, a) for _, m, a, _ in places]))
    units = list({id(specs[key]): specs[key] for m in unit_modules
                  if (key := group_of.get(id(m), id(m))) in specs and specs[key].params}.values())
    return root_spec, units


def merge_into_buckets(units: list[UnitSpec], bucket_bytes: Optional[int],
                       key: Optional[Callable[[nn.Module], Hashable]] = None) -> list[UnitSpec]:
    """Consecutive units merged by the merge rule (`overlap.base.rules.bucket_runs`); with
    `key`, only units whose first modules give equal keys share a bucket."""
    buckets = []
    for stretch in _stretches(units, key):
        for run in bucket_runs([u.nbytes for u in stretch], bucket_bytes):
            members = [stretch[i] for i in run]
            buckets.append(members[0] if len(members) == 1 else UnitSpec(
                bucket_name([u.name for u in members]), [m for u in members for m in u.modules],
                [p for u in members for p in u.params]))
    return buckets


def _stretches(units: list[UnitSpec], key: Optional[Callable[[nn.Module], Hashable]]) -> list[list[UnitSpec]]:
    """`units` cut where the key of consecutive units' first modules changes."""
    stretches: list[list[UnitSpec]] = []
    previous: object = object()
    for unit in units:
        current = None if key is None else key(unit.modules[0])
        if not stretches or current != previous:
            stretches.append([])
        stretches[-1].append(unit)
        previous = current
    return stretches
