"""Environment variables: parsing, precedence, and the README's table."""
from __future__ import annotations

import pathlib

import pytest

from overlap.base.config import ENV_VARS, Config, config_from_env


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
                                            ("OVERLAP_NVTX", "true"), ("OVERLAP_KERNELS", "cuda")])
def test_invalid_values_name_variable_and_accepted_values(variable: str, value: str) -> None:
    with pytest.raises(ValueError) as info:
        config_from_env({variable: value})
    assert variable in str(info.value) and ENV_VARS[variable][0] in str(info.value)


def test_readme_documents_every_variable() -> None:
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    for variable in ENV_VARS:
        assert f"`{variable}`" in readme, variable


def test_config_is_comparable_across_ranks() -> None:
    assert Config(prefetch_depth=1) == Config(prefetch_depth=1) != Config(prefetch_depth=2)
