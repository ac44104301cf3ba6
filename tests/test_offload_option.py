"""The `offload` option: argument > OVERLAP_OFFLOAD > "none", and clear errors on every rank
for values that are wrong or tiers that are not available."""
from __future__ import annotations

import pytest
from torch import nn

from distributed import CaseLaunch, RankCase
from overlap.base.choices import OFFLOAD_CHOICES
from overlap.base.config import ENV_VARS, config_from_env
from overlap.runtime.host_tier import offload_error


def test_environment_is_parsed_and_argument_wins() -> None:
    assert config_from_env({}).offload == "none"
    assert config_from_env({"OVERLAP_OFFLOAD": " CPU "}).offload == "cpu"
    assert config_from_env({"OVERLAP_OFFLOAD": "cpu"}).with_overrides(offload="none").offload == "none"


def test_bad_environment_value_names_the_variable_and_choices() -> None:
    with pytest.raises(ValueError) as info:
        config_from_env({"OVERLAP_OFFLOAD": "nvme"})
    message = str(info.value)
    assert "OVERLAP_OFFLOAD='nvme'" in message and ENV_VARS["OVERLAP_OFFLOAD"][0] in message
    assert all(choice in message for choice in OFFLOAD_CHOICES)


def test_none_is_always_available() -> None:
    assert offload_error("none") is None


def _wrap(rank: int, world: int, kwargs: dict) -> str:
    from overlap import ShardedModule

    model = ShardedModule(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), **kwargs)
    groups = [group for unit in model.scheduler.all_units for group in unit.groups]
    return "offloaded" if all(group.place.offloaded for group in groups) else "built"


REFUSED = [
    ({"offload": "ram"}, {}, "offload='ram' is invalid"),
    ({"offload": "CPU"}, {}, "offload='CPU' is invalid"),
    ({}, {"OVERLAP_OFFLOAD": "ssd"}, "OVERLAP_OFFLOAD='ssd' is invalid"),
    ({"offload": "disk"}, {}, "offload='disk'"),
    ({}, {"OVERLAP_OFFLOAD": "disk"}, "offload='disk'"),
]

# Every case on the same two ranks (tests/distributed.py's [Note: many cases on one launch]).
LAUNCH = CaseLaunch({
    **{f"refused-{i}": RankCase(_wrap, (kwargs,), env=env) for i, (kwargs, env, _) in enumerate(REFUSED)},
    "argument-none-env-disk": RankCase(_wrap, ({"offload": "none"},), env={"OVERLAP_OFFLOAD": "disk"}),
    "env-cpu": RankCase(_wrap, ({},), env={"OVERLAP_OFFLOAD": "cpu"}),
    "default": RankCase(_wrap, ({},)),
}, world_size=2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index,kwargs,env,expected", [(i, *case) for i, case in enumerate(REFUSED)])
def test_bad_or_unavailable_offload_fails_on_every_rank(index: int, kwargs: dict, env: dict, expected: str) -> None:
    for outcome in LAUNCH[f"refused-{index}"]:
        message = outcome.error()
        assert "ValueError" in message and expected in message, message


@pytest.mark.timeout(300)
def test_none_by_argument_beats_the_environment() -> None:
    assert [outcome.result() for outcome in LAUNCH["argument-none-env-disk"]] == ["built", "built"]


@pytest.mark.timeout(300)
def test_the_environment_turns_offload_on() -> None:
    assert [outcome.result() for outcome in LAUNCH["env-cpu"]] == ["offloaded", "offloaded"]
    assert [outcome.result() for outcome in LAUNCH["default"]] == ["built", "built"]
