"""The overlap report's all-to-all line under expert parallelism: the calls each MoE layer makes,
the bytes its routing sent other ranks, in-flight time split into exposed (waited on) and
hidden; backward's all-to-alls issued ahead of their waits; nothing of it without expert
parallelism."""
from __future__ import annotations

import pytest
import torch

from distributed import CaseLaunch, RankCase

WORLD, EP, LAYERS, EXPERTS, STEPS, VOCAB, SEQ, PER_RANK = 2, 2, 2, 4, 3, 64, 8, 2
# Per layer and step: the count exchange; per half, forward's tokens and results; per half,
# backward's results' and tokens' gradients.
CALLS_PER_LAYER = 1 + 2 * 2 + 2 * 2


def _gpt_moe() -> torch.nn.Module:
    from overlap.models.moe import GPTMoE, MoEConfig
    torch.manual_seed(0)
    return GPTMoE(MoEConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=16, n_expert=EXPERTS,
                            top_k=2, expert_hidden=8))


def _routing_log(model: torch.nn.Module, routed: list) -> None:
    """Each expert module's call appends (pairs per owner rank, bytes per token row)."""
    from overlap.runtime.expert_parallel import expert_modules

    def hook(module: torch.nn.Module, args: tuple) -> None:
        hidden, index = args[0], args[1].reshape(-1)
        kept = index[index < EXPERTS]
        routed.append((torch.bincount(torch.div(kept, EXPERTS // EP, rounding_mode="floor"), minlength=EP).tolist(),
                       hidden.shape[-1] * hidden.element_size()))

    for experts in expert_modules(model):
        experts.register_forward_pre_hook(hook)


def _train(rank: int, world: int, expert_parallel) -> dict:
    import torch.distributed as dist

    from overlap import ShardedModule

    model = _gpt_moe()
    routed: list = []
    _routing_log(model, routed)
    model = ShardedModule(model, expert_parallel=expert_parallel)
    records = []
    model.scheduler.step_end_callbacks.append(lambda s: records.append(s.last_step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=generator)
        model(idx, idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, routed)
    report = model.overlap_report()
    return {"steps": report.steps, "text": report.to_text(), "mean": report.mean_step(), "routed": everyone,
            "records": records}


def _expected_bytes(routed: list, rank: int, call: int) -> int:
    """What `rank` sent the other ranks in expert call `call` (one layer's forward and
    backward): the counts (an int64 per half and expert of each peer), the tokens it sent, the
    results of the tokens it received; in backward the gradients of the results it got back
    and of the tokens it received."""
    sent = sum(n for owner, n in enumerate(routed[rank][call][0]) if owner != rank)
    received = sum(routed[source][call][0][rank] for source in range(len(routed)) if source != rank)
    row = routed[rank][call][1]
    return 8 * 2 * (EXPERTS // EP) * (EP - 1) + 2 * row * (sent + received)


@pytest.fixture(scope="module")
def launch() -> CaseLaunch:
    return CaseLaunch({"ep": RankCase(_train, (EP,)), "no_ep": RankCase(_train, (None,))}, world_size=WORLD,
                      timeout=240)


@pytest.mark.timeout(300)
def test_the_report_counts_every_all_to_all_and_the_bytes_the_routing_sent(launch) -> None:
    for rank, outcome in enumerate(launch["ep"]):
        result = outcome.result()
        steps = result["steps"]
        assert len(steps) == STEPS
        for number, stats in enumerate(steps):
            assert stats.all_to_alls == CALLS_PER_LAYER * LAYERS
            calls = range(number * LAYERS, (number + 1) * LAYERS)
            assert stats.all_to_all_bytes == sum(_expected_bytes(result["routed"], rank, c) for c in calls)
            assert stats.all_to_all_s > 0 and 0 <= stats.all_to_all_exposed_s <= stats.all_to_all_s
            assert stats.all_to_all_hidden_s + stats.all_to_all_exposed_s == pytest.approx(stats.all_to_all_s)
        mean = result["mean"]
        line = next(line for line in result["text"].splitlines() if line.startswith("all-to-all: "))
        assert line.startswith(f"all-to-all: {CALLS_PER_LAYER * LAYERS:.1f} calls, "), line
        assert line.endswith(f"{100 * mean.all_to_all_hidden_fraction:.0f}% hidden"), line


@pytest.mark.timeout(300)
def test_backward_issues_each_all_to_all_before_waiting_for_the_other_half(launch) -> None:
    """Per layer, in backward: both halves' results' gradients issued before half 1's is
    waited for; half 1's tokens' gradients issued before half 0's results' are waited for, and
    waited for only after half 0's tokens' are issued (each behind the other half's compute)."""
    from overlap.base.step_record import ALL_TO_ALL

    for outcome in launch["ep"]:
        for record in outcome.result()["records"]:
            exchanges = [c for c in record.collectives if c.kind == ALL_TO_ALL]
            for label in dict.fromkeys(c.unit for c in exchanges):
                results_0, results_1, tokens_1, tokens_0 = [c for c in exchanges if c.unit == label][-4:]
                assert results_0.start <= results_1.start < results_1.wait[0]
                assert tokens_1.start < results_0.wait[0]
                assert tokens_0.start < tokens_1.wait[0]


@pytest.mark.timeout(300)
def test_without_expert_parallelism_the_report_has_no_all_to_all_line(launch) -> None:
    for outcome in launch["no_ep"]:
        result = outcome.result()
        assert "all-to-all" not in result["text"]
        assert all(stats.all_to_alls == 0 and stats.all_to_all_bytes == 0 for stats in result["steps"])


def test_all_to_all_time_splits_into_exposed_and_hidden_apart_from_the_gathers() -> None:
    """Two all-to-alls in flight together, one waited for: the union counts once, the wait is
    exposed and cut out of compute; the gathers' communication leaves them out."""
    from overlap.base.step_record import ALL_TO_ALL, Collective, Mark, StepKind, StepRecord, UnitEvent
    from overlap.observe.report import analyse_step

    events = (UnitEvent(Mark.PRE_FORWARD, "u", 0.0), UnitEvent(Mark.POST_FORWARD, "u", 10.0))
    collectives = (Collective("all_gather", "u", 100, 0.0, 1.0, (0.0, 1.0)),
                   Collective(ALL_TO_ALL, "experts 0", 10, 2.0, 6.0, (5.0, 6.5)),
                   Collective(ALL_TO_ALL, "experts 0", 20, 3.0, 7.0, None))
    stats = analyse_step(StepRecord(1, StepKind.TRAIN, "host", events, collectives, None, {"u": 400}))
    assert (stats.all_to_alls, stats.all_to_all_bytes) == (2, 30)
    assert stats.all_to_all_s == pytest.approx(5.0)              # 2.0 to 7.0
    assert stats.all_to_all_exposed_s == pytest.approx(1.5)      # the wait, 5.0 to 6.5
    assert stats.all_to_all_hidden_s == pytest.approx(3.5)
    assert stats.comm_s == pytest.approx(1.0) and stats.gathered_bytes == 100
    assert stats.compute_s == pytest.approx(10.0 - 1.0 - 1.5)   # both waits cut out
    assert [u.unit for u in stats.units] == ["u"]
