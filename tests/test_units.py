"""Which parameters become which unit."""
from __future__ import annotations

from torch import nn

from models import Block, FeatureNet, Tiny
from overlap.models import GPT, GPTConfig
from overlap.models import Block as GPTBlock
from overlap.base.units import discover_units, merge_into_buckets


def _names(specs) -> list[str]:
    return [s.name for s in specs]


def test_automatic_policy_takes_the_block_list() -> None:
    root, units = discover_units(GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, vocab_size=50)), None)
    assert _names(units) == ["blocks.0", "blocks.1", "blocks.2"]
    assert {name for name, _, _ in root.params} == {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}


def test_tied_parameter_is_listed_once_with_every_owner() -> None:
    root, _ = discover_units(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=50)), (GPTBlock,))
    (entry,) = [e for e in root.params if e[0] == "wte.weight"]
    assert sorted(attr for _, attr in entry[2]) == ["weight", "weight"] and len(entry[2]) == 2


def test_parameter_shared_across_units_goes_to_the_root() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Linear(3, 1)))
    root, units = discover_units(model, (nn.Sequential,))
    assert {name for name, _, _ in root.params} == {"0.0.weight", "0.0.bias"}
    assert [[n for n, _, _ in u.params] for u in units] == [["1.1.weight", "1.1.bias"]]


def test_model_without_module_list_uses_children() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    root, units = discover_units(model, None)
    assert _names(units) == ["0", "2"] and not root.params


def test_explicit_types_and_buckets() -> None:
    _, units = discover_units(FeatureNet(), (Block, Tiny))
    assert _names(units) == [f"blocks.{i}" for i in range(6)]
    sizes = [u.nbytes for u in units]
    merged = merge_into_buckets(units, sizes[0] + sizes[1])
    assert _names(merged)[0] == "blocks.0..blocks.1"
    assert sum(u.nbytes for u in merged) == sum(sizes)
    assert merge_into_buckets(units, None) == units
    assert _names(merge_into_buckets(units, 1)) == _names(units)


def test_unit_types_may_be_one_class() -> None:
    assert _names(discover_units(FeatureNet(), Block)[1]) == _names(discover_units(FeatureNet(), (Block,))[1])
    assert _names(discover_units(FeatureNet(), [Block, Tiny])[1]) == [f"blocks.{i}" for i in range(6)]


def test_unit_types_that_are_not_module_classes_are_a_type_error() -> None:
    import pytest

    for bad, named in (("Block", "'Block'"), (Block(2, 3), "Block("), ([Block, 3], "3 is not"), ((int,), "int")):
        with pytest.raises(TypeError, match="(?s)unit_types=.*expected a module class") as info:
            discover_units(FeatureNet(), bad)
        assert named in str(info.value)


def test_a_container_is_never_a_unit_its_elements_are() -> None:
    """ModuleDict and ModuleList run none of their modules (no forward, so no hooks): a stack
    held in a ModuleDict (torchtitan's, which pipeline stages cut by deleting entries), nested
    containers, and a container that is the root's only child all give their elements."""
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"3": nn.Linear(4, 4), "7": nn.Linear(4, 4)})
            self.nested = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 4)])

    _, units = discover_units(Stack(), None)
    assert [u.name for u in units] == ["layers.3", "layers.7", "nested.0.0", "nested.1"]
    _, units = discover_units(nn.Sequential(nn.ModuleDict({"a": nn.Linear(2, 2)}), nn.Linear(2, 2)), None)
    assert [u.name for u in units] == ["0.a"]
