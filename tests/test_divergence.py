"""Ranks that run different units get an error naming the step and the unit, on every rank,
within the collective timeout, instead of a hang or silently mixed parameters (see
[Note: checking that ranks run the same units] in overlap/runtime/order_check.py)."""
from __future__ import annotations

import time

import pytest

from distributed import CaseLaunch, RankCase, RankError, run_distributed

TIMEOUT_S = 60      # tests/distributed.py's process group timeout
# The blocked-wait check's wait (overlap/runtime/order_check.py: 10 s), lowered in the ranks
# of the diverging runs: a rank that is only slow is never reported, so a shorter wait checks
# the same thing, and each test that reaches the check waits 1 s instead of 10.
BLOCKED_CHECK_AFTER_S = 1.0


def _quick_blocked_check() -> None:
    from overlap.runtime import order_check

    order_check.CHECK_AFTER_S = BLOCKED_CHECK_AFTER_S


def _diverge(rank: int, world: int, how: str) -> None:
    _quick_blocked_check()
    import torch
    from torch import nn

    from overlap import ShardedModule

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Same-sized blocks: collectives of different units pair up without an error.
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
            self.order = [0, 1, 2, 3]

        def forward(self, x):
            for i in self.order:
                x = torch.tanh(self.blocks[i](x))
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    model = ShardedModule(net, prefetch_depth=1, bucket_mb=1e-6)
    x = torch.randn(4, 16)
    for step in range(1, 5):
        if step == 3 and rank == 1:
            net.order = [0, 1, 3] if how == "skip" else [0, 2, 1, 3]
        else:
            net.order = [0, 1, 2, 3]
        model(x).backward()


def _errors(how: str, order_check: str = "collective") -> tuple[dict[int, str], float]:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_diverge, 2, how, timeout=TIMEOUT_S + 60,
                        env={"OVERLAP_PROBE": "0", "OVERLAP_ORDER_CHECK": order_check})
    return info.value.errors, time.monotonic() - start


@pytest.mark.timeout(200)
def test_a_rank_that_skips_a_block_fails_every_rank_in_time() -> None:
    """Rank 1 skips block 2: its collectives pair with the wrong ones until one waits forever."""
    errors, elapsed = _errors("skip")
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert "DivergenceError" in message and "at step 3" in message
        assert "rank 1 ran unit 'blocks.3' (forward) where rank 0 ran unit 'blocks.2' (forward)" in message
    assert elapsed < TIMEOUT_S


@pytest.mark.timeout(200)
def test_units_in_another_order_fail_at_the_end_of_the_step() -> None:
    """Rank 1 runs blocks 1 and 2 the other way round: every collective completes (the
    blocks have one size), so only the check at the end of backward can see it."""
    errors, elapsed = _errors("swap")
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert "DivergenceError" in message and "at step 3" in message
        assert "rank 1 ran unit 'blocks.2' (forward) where rank 0 ran unit 'blocks.1' (forward)" in message
    assert elapsed < 30


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["skip", "swap"])
def test_without_order_words_divergence_is_still_an_error_on_every_rank(how: str) -> None:
    """OVERLAP_ORDER_CHECK=step: no word before each collective; a rank that skips or swaps
    blocks of one size is found at the end of backward or by the blocked-wait check, and
    every rank raises, naming the step, before the group's timeout."""
    errors, elapsed = _errors(how, order_check="step")
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert "DivergenceError" in message and "at step 3" in message
        assert "rank 1 ran unit" in message
    assert elapsed < TIMEOUT_S


def _diverge_sized(rank: int, world: int, how: str) -> None:
    """Blocks of four sizes: a collective paired with another unit's would abort the process
    inside gloo, so the check has to stop every rank before issuing it."""
    _quick_blocked_check()
    import torch
    from torch import nn

    from overlap import ShardedModule

    class Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, hidden), nn.Linear(hidden, 16)

        def forward(self, x):
            return torch.tanh(self.down(torch.tanh(self.up(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(hidden) for hidden in (8, 24, 40, 56))
            self.order = [0, 1, 2, 3]

        def forward(self, x):
            for i in self.order:
                x = self.blocks[i](x)
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    model = ShardedModule(net, unit_types=(Block,), prefetch_depth=1, bucket_mb=1e-6)
    x = torch.randn(4, 16)
    for step in range(1, 5):
        diverges = step == 3 and rank == 1
        net.order = {"skip": [0, 1, 3], "extra": [0, 1, 2, 2, 3]}.get(how, [0, 1, 2, 3]) if diverges else [0, 1, 2, 3]
        if diverges and how == "forwards":
            model(x)                                  # a forward with no backward, on rank 1 only
        if diverges and how == "no_sync":
            with model.no_sync():
                model(x).backward()
        else:
            model(x).backward()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how, expected", [
    ("skip", "rank 1 ran unit 'blocks.3' (forward) where rank 0 ran unit 'blocks.2' (forward)"),
    ("extra", "rank 1 ran unit 'blocks.2' (forward) where rank 0 ran unit 'blocks.3' (forward)"),
    ("forwards", "rank 1 ran the start of a forward where rank 0 ran unit 'blocks.3' (backward)"),
    ("no_sync", "rank 1 ran unit 'blocks.3' (backward under no_sync) where rank 0 ran unit 'blocks.3' (backward)"),
])
def test_ranks_that_diverge_with_blocks_of_different_sizes_fail_every_rank(how: str, expected: str) -> None:
    """Every rank raises DivergenceError naming the step and the unit before a collective of
    another size is issued: no process aborts (run_distributed would raise its exit instead
    of a RankError holding both ranks' errors), and no rank waits for the blocked check."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_diverge_sized, 2, how, timeout=TIMEOUT_S + 60, env={"OVERLAP_PROBE": "0"})
    elapsed = time.monotonic() - start
    errors = info.value.errors
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert message.startswith("DivergenceError") and "at step 3" in message
        assert expected in message
        assert "EnforceNotMet" not in message and "Read error" not in message
    assert elapsed < 30


def _agree(rank: int, world: int) -> list[int]:
    import torch
    from torch import nn

    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]), prefetch_depth=1, bucket_mb=1e-6)
    x = torch.randn(2, 8)
    steps = []
    for _ in range(3):
        model(x).sum().backward()
        with torch.no_grad():
            model(x)
        steps.append(model.scheduler.step)
    return steps


@pytest.mark.timeout(240)
def test_ranks_that_agree_see_no_error() -> None:
    assert [outcome.result() for outcome in AGREEING["agree"]] == [[2, 4, 6], [2, 4, 6]]


def _words_per_step(rank: int, world: int) -> list[int]:
    import torch
    from torch import nn

    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(nn.Sequential(*(nn.Linear(16, 16) for _ in range(4))), prefetch_depth=1, bucket_mb=1e-6)
    order = model.scheduler.order
    exchanged = [0]

    class CountedWords:
        """The order check's words group, counting the exchanges."""

        def __init__(self, group) -> None:
            self.group = group

        def allreduce(self, *args, **kwargs):
            exchanged[0] += 1
            return self.group.allreduce(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self.group, name)

    order._words = CountedWords(order._words)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    counts = []
    for step in range(14):
        before = exchanged[0]
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss)
        counts.append(exchanged[0] - before)
    return counts


# The runs where ranks agree share one launch (tests/distributed.py's [Note: many cases on one
# launch]); each diverging run has a launch of its own, since it leaves collectives unmatched.
AGREEING = CaseLaunch({"agree": RankCase(_agree), "words": RankCase(_words_per_step, env={"OVERLAP_PROBE": "0"})},
                      world_size=2, timeout=200)


@pytest.mark.timeout(240)
def test_steps_that_repeat_a_verified_one_exchange_no_order_words() -> None:
    """The first step exchanges a word before each collective; once the end-of-backward check
    has verified a step's sequence of collectives and older ones have aged out, the steps that
    repeat it exchange none."""
    for counts in (outcome.result() for outcome in AGREEING["words"]):
        assert counts[0] > 0 and counts[-4:] == [0, 0, 0, 0], counts


def _evaluate_alone(rank: int, world: int) -> None:
    _quick_blocked_check()
    import torch
    from torch import nn

    from overlap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(nn.Sequential(*(nn.Linear(16, 16) for _ in range(4))), prefetch_depth=1, bucket_mb=1e-6)
    x = torch.randn(4, 16)
    for step in range(1, 9):
        if step == 7 and rank == 1:
            with torch.no_grad():                 # an evaluation forward where rank 0 trains
                model(x)
        else:
            model(x).square().mean().backward()


@pytest.mark.timeout(200)
def test_a_rank_that_evaluates_while_the_others_train_fails_every_rank() -> None:
    """Steady steps exchange no words; rank 1 then runs a forward without backward where rank
    0 trains: its collectives leave the verified sequence, it exchanges words, and every rank
    raises the divergence in time, without a mismatched collective (no process aborts)."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_evaluate_alone, 2, timeout=TIMEOUT_S + 60, env={"OVERLAP_PROBE": "0"})
    errors = info.value.errors
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert "DivergenceError" in message and "at step 7" in message
    assert time.monotonic() - start < TIMEOUT_S
