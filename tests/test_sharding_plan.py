"""The two-level planner: collectives priced on the link of their group, the choice among
full, hybrid and hpZ sharding, OVERLAP_LINK per level, `overlap simulate --nodes`, and
sharding="auto" on 4 ranks told they are 2 nodes of 2."""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from overlap.base.config import config_from_env
from overlap.plan.cost_model import Profile, UnitCost, predict_step
from overlap.plan.sharding import Levels, choose_sharding, evaluate, layout_for
from overlap.cli.simulate import main as simulate
from overlap.plan.links import LinkModel

MB = 2**20
NODE = LinkModel("nvlink", 10e-6, 300e9)
NETWORK = LinkModel("ethernet", 100e-6, 1e9)
WORLD = LinkModel("ethernet", 120e-6, 0.9e9)
LEVELS = Levels(2, 4, NODE, NETWORK, WORLD)        # 8 ranks


def _ring(link: LinkModel, ranks: int, nbytes: float) -> float:
    return link.alpha + nbytes * (ranks - 1) / ranks / link.beta


def _units(n: int = 2, mb: float = 64.0) -> tuple[UnitCost, ...]:
    size = int(mb * MB)
    return tuple(UnitCost(f"u{i}", size, size // 2, size) for i in range(n))


@pytest.mark.parametrize("sharding", ["full", "hybrid", "hpz"])
def test_each_collective_is_priced_on_its_groups_link(sharding: str) -> None:
    """Two units, no compute: forward gathers both, backward re-gathers the first (the last
    stays gathered), both are reduced. Communication summed by hand from the α-β formulas."""
    units = _units()
    gather, reduce = units[0].gather_bytes, units[0].reduce_bytes
    ranks = 4 if sharding == "hybrid" else 8
    prediction = predict_step(Profile(units, ranks), layout_for(sharding, LEVELS), 1, 1)
    if sharding == "full":
        expected = 3 * _ring(WORLD, 8, gather) + 2 * _ring(WORLD, 8, reduce)
    elif sharding == "hybrid":
        across = NETWORK.alpha + 2 * (reduce / 4) * (2 - 1) / 2 / NETWORK.beta     # all-reduce of the shard
        expected = 3 * _ring(NODE, 4, gather) + 2 * _ring(NODE, 4, reduce) + 2 * across
    else:
        expected = 2 * _ring(WORLD, 8, gather) + _ring(NODE, 4, gather) + 2 * _ring(WORLD, 8, reduce)
    assert prediction.comm_s == pytest.approx(expected, rel=1e-9)


def test_one_link_layout_predicts_as_before() -> None:
    units = _units(4)
    a = predict_step(Profile(units, 8), WORLD, 2, 2)
    b = predict_step(Profile(units, 8), layout_for("full", LEVELS), 2, 2)
    assert a.step_s == pytest.approx(b.step_s) and a.comm_s == pytest.approx(b.comm_s)


def test_hybrid_all_reduce_runs_beside_node_gathers() -> None:
    """The network all-reduce and the node's collectives use different wires, so the step
    is shorter than their sum."""
    units = _units(6)
    prediction = predict_step(Profile(units, 4), layout_for("hybrid", LEVELS), 1, 1)
    assert prediction.step_s < prediction.comm_s


def test_slow_network_picks_hybrid_when_it_fits() -> None:
    choice = choose_sharding(_units(8), LEVELS, None, memory_limit=2**40)
    steps = {o.sharding: o.prediction.step_s for o in choice.options}
    assert choice.pick.sharding == "hybrid"
    assert steps["hybrid"] < steps["hpz"] < steps["full"]
    assert "hybrid" in choice.describe() and "full" in choice.describe() and "hpz" in choice.describe()


def test_memory_limit_excludes_hybrid() -> None:
    """Hybrid holds the states over 4 ranks instead of 8: a limit between the two leaves
    hpZ (next fastest, its node copies included in its memory)."""
    units = _units(8)
    memory = {s: evaluate(s, units, LEVELS, None).memory_bytes for s in ("full", "hybrid", "hpz")}
    assert memory["full"] < memory["hpz"] < memory["hybrid"]
    choice = choose_sharding(units, LEVELS, None, memory_limit=memory["hpz"])
    assert choice.pick.sharding == "hpz"
    # Without hpZ among the candidates (expert parallelism refuses it), full sharding.
    without = choose_sharding(units, LEVELS, None, memory_limit=memory["hpz"], shardings=("full", "hybrid"))
    assert without.pick.sharding == "full" and {o.sharding for o in without.options} == {"full", "hybrid"}


def test_hidden_communication_picks_least_memory() -> None:
    """When compute hides every collective of every option, the steps tie and full
    sharding, which holds the least, wins."""
    units = tuple(UnitCost(u.name, u.nbytes, u.gather_bytes, u.reduce_bytes, 5.0, 10.0) for u in _units(8))
    choice = choose_sharding(units, LEVELS, None, memory_limit=2**40)
    assert choice.pick.sharding == "full"
    assert max(o.prediction.exposed_s for o in choice.options) < 0.05 * choice.pick.prediction.step_s


def test_link_per_level_from_env() -> None:
    assert config_from_env({"OVERLAP_LINK": "nvlink,infiniband"}).link == "nvlink,infiniband"
    assert config_from_env({"OVERLAP_LINK": "ethernet"}).link == "ethernet"
    for bad in ("nvlink,auto", "nvlink,infiniband,ethernet", "nvlink,token-ring"):
        with pytest.raises(ValueError, match="OVERLAP_LINK"):
            config_from_env({"OVERLAP_LINK": bad})
    assert config_from_env({"OVERLAP_SHARDING": "auto"}).sharding == "auto"
    assert config_from_env({"OVERLAP_SHARDING": "hpz"}).sharding == "hpz"


def test_simulate_compares_shardings_on_two_levels() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        simulate(["--model", "llama3-8b", "--cluster", "2x8xH100-ib-ndr", "--nodes", "16"])
    text = out.getvalue()
    assert "sharding on 16 nodes x 8 GPUs" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["full"], ["hybrid"], ["hpz"])]
    assert [row[0] for row in rows] == ["full", "hybrid", "hpz"]
    assert sum("sharding=auto" in line for line in text.splitlines()) == 1
    with pytest.raises(SystemExit):
        simulate(["--model", "llama3-8b", "--cluster", "2x8xH100-ib-ndr", "--nodes", "0"])


def _auto(rank: int, world: int) -> dict:
    import logging

    from parity import train
    from parity_cases import CASES

    os.environ.update(LOCAL_WORLD_SIZE="2", OVERLAP_LINK="nvlink,ethernet", OVERLAP_PROBE="0")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("overlap").addHandler(handler)
    logging.getLogger("overlap").setLevel(logging.INFO)
    case = CASES["gpt_adamw_groups"]
    case.wrap = {**case.wrap, "sharding": "auto"}
    result = train(case, rank, world, sharded=True)
    result["log"] = [line for line in lines if line.startswith("sharding ")]
    return result


@pytest.mark.timeout(300)
def test_auto_sharding_takes_rank0s_choice_and_trains_like_one_process() -> None:
    from distributed import run_distributed
    from parity import train
    from parity_cases import CASES

    results = run_distributed(_auto, 4, timeout=240)
    # NVLink inside, Ethernet across (class defaults, no probe): hybrid sharding.
    assert {r["sharding"] for r in results} == {"hybrid sharding: 2 ranks per shard group, 2 replicas"}
    assert results[0]["log"] and results[0]["log"][0].startswith("sharding hybrid: predicted full ")
    assert "compute not measured" in results[0]["log"][0]
    case, ref = CASES["gpt_adamw_groups"], train(CASES["gpt_adamw_groups"])
    tol = {"rtol": case.rtol, "atol": case.atol}
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), **tol)
    for key, expected in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][key], expected, **tol, msg=lambda m: f"{key}: {m}")
