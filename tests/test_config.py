"""Environment variables: parsing, precedence, and the README's table."""
from __future__ import annotations

import pathlib

import pytest

from overlap.base.config import (ENV_VARS, Config, config_from_env, local_rank_from_env, local_world_size_from_env,
                                 validate_flag)


def test_defaults_leave_choices_to_the_planner() -> None:
    config = config_from_env({})
    assert config.prefetch_depth is None and config.bucket_mb is None and config.kernels == "auto"


def test_values_are_parsed() -> None:
    config = config_from_env({"OVERLAP_PREFETCH_DEPTH": "3", "OVERLAP_BUCKET_MB": "12.5",
                              "OVERLAP_KERNELS": "torch", "OVERLAP_NVTX": "1", "OVERLAP_LOG": "info",
                              "OVERLAP_LINK": "infiniband", "OVERLAP_MEMORY_BUDGET_MB": "512"})
    assert (config.prefetch_depth, config.bucket_mb, config.kernels, config.nvtx, config.log_level,
            config.link, config.memory_budget_mb) == (3, 12.5, "torch", True, "INFO", "infiniband", 512.0)


def test_auto_means_unset() -> None:
    config = config_from_env({"OVERLAP_PREFETCH_DEPTH": "auto", "OVERLAP_BUCKET_MB": "AUTO"})
    assert config.prefetch_depth is None and config.bucket_mb is None


def test_arguments_beat_environment() -> None:
    config = config_from_env({"OVERLAP_PREFETCH_DEPTH": "3"}).with_overrides(prefetch_depth=0, bucket_mb=None)
    assert config.prefetch_depth == 0 and config.bucket_mb is None


@pytest.mark.parametrize("variable,value", [("OVERLAP_PREFETCH_DEPTH", "1.5"), ("OVERLAP_BUCKET_MB", "-1"),
                                            ("OVERLAP_NVTX", "true"), ("OVERLAP_KERNELS", "cuda"),
                                            ("OVERLAP_SHARDING", "zero2"), ("OVERLAP_ORDER_CHECK", "never"),
                                            ("OVERLAP_PROBE", "yes"), ("OVERLAP_HOST_GBPS", "0"),
                                            ("OVERLAP_HOST_GBPS", "nan"), ("OVERLAP_HOST_GBPS", "fast"),
                                            ("OVERLAP_COMPILE", "no"), ("OVERLAP_COMPILE", "true")])
def test_invalid_values_name_variable_and_accepted_values(variable: str, value: str) -> None:
    with pytest.raises(ValueError) as info:
        config_from_env({variable: value})
    assert variable in str(info.value) and ENV_VARS[variable][0] in str(info.value)


def test_the_other_choices_are_parsed() -> None:
    config = config_from_env({"OVERLAP_SHARDING": "Hybrid", "OVERLAP_ORDER_CHECK": "step", "OVERLAP_PROBE": "0",
                              "OVERLAP_HOST_GBPS": "12.5", "OVERLAP_COMPILE": "1"})
    assert (config.sharding, config.order_check, config.probe, config.host_gbps, config.compile) == \
        ("hybrid", "step", False, 12.5, True)


@pytest.mark.parametrize("variable,value", [("LOCAL_RANK", "one"), ("LOCAL_RANK", "-1"), ("LOCAL_RANK", ""),
                                            ("LOCAL_WORLD_SIZE", "0"), ("LOCAL_WORLD_SIZE", "2.5"),
                                            ("LOCAL_WORLD_SIZE", "eight")])
def test_launcher_garbage_names_the_variable(variable: str, value: str) -> None:
    read = local_rank_from_env if variable == "LOCAL_RANK" else local_world_size_from_env
    with pytest.raises(ValueError, match=f"{variable}={value!r} is invalid; expected an integer >= "):
        read({variable: value})


def test_launcher_values_are_read() -> None:
    assert (local_rank_from_env({"LOCAL_RANK": "3"}), local_world_size_from_env({"LOCAL_WORLD_SIZE": "8"})) == (3, 8)
    assert local_rank_from_env({}) is None and local_world_size_from_env({}) is None


@pytest.mark.parametrize("value", ["no", "yes", 0, 1, None, 0.0])
def test_a_flag_argument_is_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match=f"compile={value!r} is invalid; expected True or False"):
        validate_flag(value, "compile")
    assert validate_flag(False, "compile") is False and validate_flag(True, "compile") is True


def test_readme_documents_every_variable() -> None:
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    for variable in ENV_VARS:
        assert f"`{variable}`" in readme, variable


def test_config_is_comparable_across_ranks() -> None:
    assert Config(prefetch_depth=1) == Config(prefetch_depth=1) != Config(prefetch_depth=2)
