"""Prefetch order, depth and the communication volume of a step."""
from __future__ import annotations

import pytest
import torch

from distributed import CaseLaunch, RankCase
from overlap.models import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=5, n_head=2, n_embd=32)


def _events_of_step_two(rank: int, world: int, depth: int, reshard: bool) -> dict:
    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(GPT(CONFIG), unit_types=(Block,), prefetch_depth=depth, bucket_mb=1e-3,
                          reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 12))
    for _ in range(2):
        model(tokens, tokens).backward()
        opt.step()
        opt.zero_grad()
    groups = [g for u in model.scheduler.all_units for g in u.groups]
    record = model.scheduler.last_step
    return {
        "events": [(e.mark.value, e.unit) for e in record.events],
        "max_gathered": model.scheduler.max_gathered_units,
        "comm_bytes": sum(c.nbytes for c in record.collectives),
        "kinds": sorted({c.kind for c in record.collectives}),
        "unit_bytes": sum(g.padded_numel * 4 for u in model.scheduler.units for g in u.groups),
        "root_bytes": sum(g.padded_numel * 4 for g in model.scheduler.root.groups),
        "last_unit_bytes": sum(g.padded_numel * 4 for g in model.scheduler.units[-1].groups),
        "num_groups": len(groups),
    }


def _first(events: list, kind: str, name: str) -> int:
    return events.index((kind, name))


def _events(world: int, depth: int, reshard: bool) -> dict:
    return LAUNCHES[world][f"events-depth{depth}-reshard{reshard}"][0].result()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("depth", [1, 2])
def test_next_units_are_gathered_before_the_current_one_computes(depth: int) -> None:
    result = _events(2, depth, True)
    events = result["events"]
    blocks = [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    # Forward: while block i computes (its pre_forward is the start of its compute), the
    # gathers of blocks i+1..i+depth have been issued, and block i+depth+1's has not.
    for i, name in enumerate(blocks):
        start = _first(events, "pre_forward", name)
        for ahead in blocks[i + 1:i + 1 + depth]:
            assert _first(events, "prefetch", ahead) < start, (name, ahead)
        beyond = blocks[i + 1 + depth:]
        if beyond:
            assert _first(events, "prefetch", beyond[0]) > start, (name, beyond[0])
    # No block was gathered on demand in forward: every one was a prefetch hit.
    forward = events[:_first(events, "post_forward", "<root>")]
    assert not [e for e in forward if e[0] == "miss"]
    # Backward runs the blocks in reverse, each prefetched (from the end of forward on)
    # before the one before it computes.
    backward = events[_first(events, "post_forward", "<root>"):]
    order = [name for kind, name in backward if kind == "pre_backward" and name != "<root>"]
    assert order == blocks[::-1]
    assert not [e for e in backward if e[0] == "miss"]
    for current, following in zip(order, order[1:]):
        assert backward.index(("prefetch", following)) < backward.index(("pre_backward", current))
    assert result["max_gathered"] <= depth + 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reshard", [True, False])
def test_bytes_per_step_match_zero3(world: int, reshard: bool) -> None:
    """Per rank and step: the units are gathered in forward and (if resharded) again in
    backward, and their gradients reduce-scattered: 3Ψ(N-1)/N (2Ψ(N-1)/N without resharding).
    The root unit, and the unit that ends forward, stay gathered from forward into backward
    (they would be gathered again at once), so they count twice in both modes."""
    result = _events(world, 1, reshard)
    passes = 3 if reshard else 2
    kept = result["last_unit_bytes"] if reshard else 0
    expected = (passes * result["unit_bytes"] + 2 * result["root_bytes"] - kept) * (world - 1) // world
    assert result["kinds"] == ["all_gather", "reduce_scatter"]
    assert abs(result["comm_bytes"] - expected) <= result["num_groups"] * passes


def _order_change(rank: int, world: int) -> list[dict]:
    from models import Block as TestBlock
    from models import Reorderable
    from overlap import ShardedModule

    torch.manual_seed(0)
    inner = Reorderable()
    model = ShardedModule(inner, unit_types=(TestBlock,), prefetch_depth=1, bucket_mb=1e-3)
    tokens = torch.randint(0, 37, (2, 6))
    steps = []
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 0, 2], [3, 1, 0, 2]):
        inner.order = order
        model(tokens, tokens).backward()
        kinds = [e.mark.value for e in model.scheduler.last_step.events]
        steps.append({"misses": kinds.count("miss"), "hits": kinds.count("hit")})
    return steps


@pytest.mark.timeout(600)
def test_prefetch_follows_a_changed_order() -> None:
    """A new order costs misses for one step only; prefetch is never switched off."""
    steps = LAUNCHES[2]["order-change"][0].result()
    # Step 1 knows no order yet: all four blocks miss. Step 2 has learned it.
    assert steps[0]["misses"] == 4 and steps[1]["misses"] == 0
    # Step 3 runs another order: some gathers miss, but prefetch goes on from the known order.
    assert 0 < steps[2]["misses"] < 8 and steps[2]["hits"] > 0
    # Step 4 has learned the new order.
    assert steps[3]["misses"] == 0 and steps[3]["hits"] == steps[1]["hits"] == 7   # 4 + 3: the last
    # block of forward stays gathered for backward


def _with_budget(rank: int, world: int, budget_units: int) -> int:
    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(GPT(CONFIG), unit_types=(Block,), prefetch_depth=3, bucket_mb=1e-3)
    unit_bytes = model.scheduler.units[0].gathered_nbytes
    model.scheduler.memory_budget_bytes = budget_units * unit_bytes
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 12))
    for _ in range(2):
        model(tokens, tokens).backward()
    return model.scheduler.max_gathered_units


@pytest.mark.timeout(600)
def test_memory_budget_caps_prefetch() -> None:
    assert LAUNCHES[2]["budget-2"][0].result() <= 2
    assert LAUNCHES[2]["budget-100"][0].result() == 4      # depth 3 + the unit computing


def _events_cases(settings: list[tuple[int, bool]]) -> dict[str, RankCase]:
    return {f"events-depth{depth}-reshard{reshard}": RankCase(_events_of_step_two, (depth, reshard))
            for depth, reshard in settings}


# One launch per world size, its cases in turn (tests/distributed.py's [Note: many cases on one launch]).
class _Lookup(torch.nn.Embedding):
    """An embedding whose class has a forward of its own (the runtime cannot tell what it reads)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx)


def _embedding_gathers(rank: int, world: int) -> dict:
    """A model whose nn.Embedding is a unit of its own, and the same with an embedding class of
    its own: two SGD steps each, the losses and each unit's gathers per step."""
    from overlap import ShardedModule

    out = {}
    for name, embedding in (("nn.Embedding", torch.nn.Embedding), ("own class", _Lookup)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(embedding(37, 16), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 37))
        model = ShardedModule(net, unit_types=(embedding, torch.nn.Linear), bucket_mb=1e-6, prefetch_depth=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, 37, (2 * world, 6), generator=torch.Generator().manual_seed(1))[2 * rank:2 * rank + 2]
        losses = []
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        report = model.overlap_report()
        out[name] = {"losses": losses, "gathers": {u.unit: u.gathers for u in report.steps[-1].units},
                     "decided": report.decisions}
    return out


@pytest.mark.timeout(600)
def test_an_embeddings_unit_is_gathered_for_forward_only() -> None:
    """An nn.Embedding's backward reads its indices, not its weight: its unit is gathered once a
    step and the report says so; an embedding class with a forward of its own is gathered
    again for backward; the losses are the same."""
    for outcome in LAUNCHES[2]["embedding"]:
        result = outcome.result()
        plain, own = result["nn.Embedding"], result["own class"]
        assert plain["losses"] == own["losses"], (plain, own)
        assert plain["gathers"]["0"] == 1 and own["gathers"]["0"] == 2, (plain["gathers"], own["gathers"])
        assert plain["decided"] == ["not gathered again for backward, whose computation reads none of their "
                                    "weights (embeddings, or set_unshard_in_backward(False)): 0"], plain["decided"]
        assert own["decided"] == [], own["decided"]


LAUNCHES = {
    2: CaseLaunch({**_events_cases([(1, True), (2, True), (1, False)]), "order-change": RankCase(_order_change),
                   "budget-2": RankCase(_with_budget, (2,)), "budget-100": RankCase(_with_budget, (100,)),
                   "embedding": RankCase(_embedding_gathers)},
                  world_size=2, timeout=500),
    3: CaseLaunch(_events_cases([(1, True), (1, False)]), world_size=3, timeout=500),
}
