"""Settings shared by the whole test session."""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

try:
    import triton
except ImportError:
    triton = None

# Triton runs CPU tensors only through its interpreter, and `overlap.kernels.triton_backend`
# builds its kernels for whichever mode is on when it is first imported: switched on here,
# before any test module probes the backends, so that every module sees the same Triton
# backend whatever order the files run in.
if triton is not None and not torch.cuda.is_available():
    triton.knobs.runtime.interpret = True


# [Note: compiled tests without SIMD kernels]
# The compiled tests check ShardedModule's units under torch.compile (one graph per unit, no
# recompiles, training equal to eager), not the vectorisation of Inductor's C++ kernels. On
# CPU, Inductor compiles each kernel with g++ (about 2 s each), first probes the CPU's vector
# instruction sets (a compile per set) and builds a precompiled header of its vector code:
# with vectorisation off, the kernels are scalar C++ and none of that runs; the three files
# that compile most took 147 CPU-s instead of 179 (paired runs). Set here, at import, so that
# every rank, `overlap train` job and script the tests start inherits it; a value the caller
# set is kept. GPU kernels (Triton) are not affected.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


# [Note: the longest files first]
# `make test` runs the files on two pytest-xdist workers, a whole file to a worker (its
# `CaseLaunch` runs once), handed out in collection order (`--no-loadscope-reorder`: xdist
# would otherwise hand out the files with most tests first), so a file of minutes collected
# last would run alone at the end while the other worker idles: these, the longest by
# `--durations` (tens of seconds to minutes of building, launches or compiles each; in the
# order of each file's summed durations in a `make test` run), are collected first; the rest
# follow in their usual order and fill the gaps.
LONGEST_FIRST = ["test_install.py", "test_fsdp2_conformance.py", "test_elastic_restarts.py", "test_benchmarks.py",
                 "test_train_job.py", "test_compile.py", "test_train_resume.py", "test_fully_shard.py",
                 "test_tensor_parallel.py", "test_expert_parallel.py", "test_parity.py", "test_train_pipeline.py",
                 "test_offload_disk.py", "test_pipeline.py", "test_integration_examples.py", "test_hybrid.py",
                 "test_state_dict_api.py", "test_quant_kernels.py", "test_combinations.py", "test_clean_exit.py",
                 "test_cuda_sources.py", "test_compression.py", "test_kernels.py", "test_offload_cpu.py",
                 "test_expert_parallel_combinations.py", "test_gpu_check.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)        # stable: a file's tests keep their order


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: cannot be made fast (a wheel built and installed into a fresh "
                                       "environment, benchmarks run over every implementation); `make test` and CI "
                                       "leave these out, `make test-all` runs them")


@pytest.fixture(scope="session", autouse=True)
def shared_probe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One link-probe cache for the session (unless the caller set OVERLAP_PROBE_CACHE).

    Each ShardedModule whose plan is not fixed by hand times the group's link at start-up, a
    second or more per wrap with several ranks on two loaded cores; hundreds of wraps paid it
    again for the same loopback link. With the cache, the first wrap of each world size
    probes and writes the fit, the later ones read it: both paths still run, the probe's own
    behaviour is tested with a cache of its own (tests/test_planner.py), and the ranks and
    jobs the tests launch inherit the setting.
    """
    if "OVERLAP_PROBE_CACHE" in os.environ:
        yield os.environ["OVERLAP_PROBE_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("probe") / "probe.json")
    os.environ["OVERLAP_PROBE_CACHE"] = path
    try:
        yield path
    finally:
        os.environ.pop("OVERLAP_PROBE_CACHE", None)


@pytest.fixture(scope="session", autouse=True)
def shared_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Inductor cache for the session (unless the caller set TORCHINDUCTOR_CACHE_DIR): the
    ranks of every compiled test (tests/test_compile.py) compile the same small graphs, tens of
    seconds each on CPU when cold; with one cache each is compiled once and read afterwards."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield os.environ["TORCHINDUCTOR_CACHE_DIR"]
        return
    path = str(tmp_path_factory.mktemp("inductor"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield path
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
