"""Runtime settings: the one place that reads `OVERLAP_*` environment variables (and the
launcher's LOCAL_RANK).

Precedence for every setting: explicit argument > environment variable > automatic choice
(`None` here means "let the planner decide"). Invalid values raise `ValueError` naming the
variable and what it accepts.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from overlap.base.choices import (COMPRESS_CHOICES, KERNEL_CHOICES, LINK_CHOICES, OFFLOAD_CHOICES, ORDER_CHECKS,
                                  SHARDING_CHOICES)
from overlap.kernels.quantized import DEFAULT_BLOCK, MAX_BLOCK

LOG_CHOICES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# name -> (accepted values as users read them, description) for the README and error messages.
ENV_VARS: dict[str, tuple[str, str]] = {
    "OVERLAP_PREFETCH_DEPTH": ("integer >= 0 or 'auto'", "units whose all-gather runs ahead of compute"),
    "OVERLAP_BUCKET_MB": ("number > 0 or 'auto'", "merge consecutive small units up to this size"),
    "OVERLAP_KERNELS": ("|".join(KERNEL_CHOICES), "flat-buffer kernel backend"),
    "OVERLAP_NVTX": ("0|1", "emit NVTX ranges for Nsight Systems"),
    "OVERLAP_LOG": ("|".join(LOG_CHOICES), "level of the 'overlap' logger"),
    "OVERLAP_LINK": ("|".join(LINK_CHOICES) + ", or two of them as INSIDE,ACROSS (e.g. nvlink,infiniband)",
                     "force the link class the planner assumes, one for all ranks or one per level"),
    "OVERLAP_MEMORY_BUDGET_MB": ("number > 0 or 'auto'", "cap on gathered parameter bytes in flight"),
    "OVERLAP_KEEP_UNITS": ("integer >= 0 or 'auto'", "units kept gathered across a step's microbatches under a "
                           "pipeline schedule (docs/pipeline.md)"),
    "OVERLAP_PROBE": ("0|1", "time a few collectives at start-up to fit the link model"),
    "OVERLAP_PROBE_CACHE": ("file path", "JSON file where probe results are kept and reused"),
    "OVERLAP_SHARDING": ("|".join(SHARDING_CHOICES),
                         "shard over every rank, inside each node and replicate across nodes, or over every "
                         "rank with a node-local copy for backward (ZeRO++ hpZ); auto: the planner chooses"),
    "OVERLAP_COMPRESS": ("|".join(COMPRESS_CHOICES), "quantise weights / gradients on the wire (docs/compression.md)"),
    "OVERLAP_COMPRESS_BLOCK": (f"even integer from 2 to {MAX_BLOCK}", "elements per quantisation scale"),
    "OVERLAP_ORDER_CHECK": ("|".join(ORDER_CHECKS),
                            "ranks agree on each collective before issuing it (a word wherever their steps could "
                            "part from verified ones), or compare what they ran once a step (docs/host_cost.md)"),
    "OVERLAP_HOST_GBPS": ("number > 0 or 'auto'", "device <-> host copy bandwidth (GB/s) the offload estimate assumes"),
    "OVERLAP_DISK_GBPS": ("number > 0 or 'auto'", "disk bandwidth (GB/s) the disk-offload estimate assumes"),
    "OVERLAP_COMPILE": ("0|1", "compile each unit's compute with torch.compile, collectives outside (docs/compile.md)"),
    "OVERLAP_OFFLOAD": ("|".join(OFFLOAD_CHOICES),
                        "where master shards, gradient shards and optimizer state live: the device, host memory "
                        "or local disk (docs/offload.md)"),
    "OVERLAP_DISK_WINDOW_MB": ("number >= 0 or 'auto'", "host memory per rank that offload='disk' may hold its "
                               "state in, read ahead during backward and written behind the step (0: none; "
                               "docs/offload_disk.md)"),
    "OVERLAP_EXPERT_CHUNKS": ("integer >= 1 or 'auto'", "chunks each MoE layer's tokens bound for other ranks "
                              "are split into under expert parallelism, each chunk's all-to-all behind another's "
                              "expert compute (docs/moe.md)"),
    "OVERLAP_OFFLOAD_DIR": ("directory path", "where offload='disk' keeps each rank's state file (default: a fresh "
                            "temporary directory per rank, removed at exit)"),
}


@dataclass(frozen=True)
class Config:
    prefetch_depth: Optional[int] = None
    bucket_mb: Optional[float] = None
    kernels: str = "auto"
    nvtx: bool = False
    log_level: Optional[str] = None
    link: str = "auto"
    memory_budget_mb: Optional[float] = None
    keep_units: Optional[int] = None       # None: the planner's (overlap.plan.microbatch_keep)
    probe: bool = True
    probe_cache: Optional[str] = None
    sharding: str = "full"
    compress: str = "none"
    compress_block: int = DEFAULT_BLOCK
    order_check: str = "collective"
    host_gbps: Optional[float] = None      # None: the link table's (overlap.plan.links)
    disk_gbps: Optional[float] = None
    compile: bool = False
    offload: str = "none"
    offload_dir: Optional[str] = None      # None: a fresh temporary directory per rank
    disk_window_mb: Optional[float] = None  # None: the planner's share of host memory (overlap.plan.budget)
    expert_chunks: Optional[int] = None    # None: overlap.runtime.expert_parallel.DEFAULT_CHUNKS

    def with_overrides(self, **overrides: object) -> "Config":
        """A copy with each non-None keyword replacing the current value (arguments beat env)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _parse_auto_number(name: str, raw: str, *, integer: bool, minimum: float, strict: bool):
    if raw.strip().lower() == "auto":
        return None
    accepted = ENV_VARS[name][0]
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is invalid; accepted values: {accepted}") from None
    if value < minimum or (strict and value == minimum) or value != value:
        raise ValueError(f"{name}={raw!r} is invalid; accepted values: {accepted}")
    return value


def _parse_choice(name: str, raw: str, choices: tuple[str, ...], *, upper: bool = False) -> str:
    value = raw.strip().upper() if upper else raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is invalid; accepted values: {ENV_VARS[name][0]}")
    return value


def _parse_flag(name: str, raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} is invalid; accepted values: {ENV_VARS[name][0]}")
    return raw.strip() == "1"


def validate_prefetch_depth(value: int, source: str = "prefetch_depth") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{source}={value!r} is invalid; expected an integer >= 0")
    return value


def validate_bucket_mb(value: float, source: str = "bucket_mb") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{source}={value!r} is invalid; expected a number > 0")
    return float(value)


def validate_flag(value: bool, source: str) -> bool:
    """A yes/no argument: only `True` or `False`. [Note: "no" and 0.0 would otherwise read as
    a choice: the string "no" is truthy, so `compile="no"` would compile.]"""
    if not isinstance(value, bool):
        raise ValueError(f"{source}={value!r} is invalid; expected True or False")
    return value


def validate_sharding(value: str, source: str = "sharding") -> str:
    if value not in SHARDING_CHOICES:
        raise ValueError(f"{source}={value!r} is invalid; expected one of {', '.join(SHARDING_CHOICES)}")
    return value


def validate_compress(value: str, source: str = "compression") -> str:
    if value not in COMPRESS_CHOICES:
        raise ValueError(f"{source}={value!r} is invalid; expected one of {', '.join(COMPRESS_CHOICES)}")
    return value


def validate_offload(value: str, source: str = "offload") -> str:
    if value not in OFFLOAD_CHOICES:
        raise ValueError(f"{source}={value!r} is invalid; expected one of {', '.join(OFFLOAD_CHOICES)}")
    return value


def _parse_block(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 2 or value > MAX_BLOCK or value % 2:
        raise ValueError(f"OVERLAP_COMPRESS_BLOCK={raw!r} is invalid; accepted values: {ENV_VARS['OVERLAP_COMPRESS_BLOCK'][0]}")
    return value


def _launcher_int(name: str, minimum: int, environ: Optional[Mapping[str, str]]) -> Optional[int]:
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r} is invalid; expected an integer >= {minimum}")
    return value


def local_rank_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The launcher's LOCAL_RANK (torchrun sets it), or None when it is not set."""
    return _launcher_int("LOCAL_RANK", 0, environ)


def local_world_size_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The launcher's LOCAL_WORLD_SIZE (ranks on this node; torchrun sets it), or None."""
    return _launcher_int("LOCAL_WORLD_SIZE", 1, environ)


# Variables of torch.distributed's backends that start-up looks at (not OVERLAP_*; see
# overlap/runtime/process_group.py `check_backend_env`).
BACKEND_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def backend_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables of BACKEND_VARS that are set, as they are."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in BACKEND_VARS if name in env}


def config_from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Read and validate every `OVERLAP_*` variable."""
    env = os.environ if environ is None else environ
    fields: dict[str, object] = {}
    if "OVERLAP_PREFETCH_DEPTH" in env:
        fields["prefetch_depth"] = _parse_auto_number(
            "OVERLAP_PREFETCH_DEPTH", env["OVERLAP_PREFETCH_DEPTH"], integer=True, minimum=0, strict=False)
    if "OVERLAP_BUCKET_MB" in env:
        fields["bucket_mb"] = _parse_auto_number(
            "OVERLAP_BUCKET_MB", env["OVERLAP_BUCKET_MB"], integer=False, minimum=0, strict=True)
    if "OVERLAP_KERNELS" in env:
        fields["kernels"] = _parse_choice("OVERLAP_KERNELS", env["OVERLAP_KERNELS"], KERNEL_CHOICES)
    if "OVERLAP_NVTX" in env:
        fields["nvtx"] = _parse_flag("OVERLAP_NVTX", env["OVERLAP_NVTX"])
    if "OVERLAP_LOG" in env:
        fields["log_level"] = _parse_choice("OVERLAP_LOG", env["OVERLAP_LOG"], LOG_CHOICES, upper=True)
    if "OVERLAP_LINK" in env:
        levels = env["OVERLAP_LINK"].split(",")
        if len(levels) > 2 or (len(levels) == 2 and "auto" in [v.strip().lower() for v in levels]):
            raise ValueError(f"OVERLAP_LINK={env['OVERLAP_LINK']!r} is invalid; accepted values: "
                             f"{ENV_VARS['OVERLAP_LINK'][0]}")
        fields["link"] = ",".join(_parse_choice("OVERLAP_LINK", v, LINK_CHOICES) for v in levels)
    if "OVERLAP_KEEP_UNITS" in env:
        fields["keep_units"] = _parse_auto_number(
            "OVERLAP_KEEP_UNITS", env["OVERLAP_KEEP_UNITS"], integer=True, minimum=0, strict=False)
    if "OVERLAP_MEMORY_BUDGET_MB" in env:
        fields["memory_budget_mb"] = _parse_auto_number(
            "OVERLAP_MEMORY_BUDGET_MB", env["OVERLAP_MEMORY_BUDGET_MB"], integer=False, minimum=0, strict=True)
    if "OVERLAP_PROBE" in env:
        fields["probe"] = _parse_flag("OVERLAP_PROBE", env["OVERLAP_PROBE"])
    if "OVERLAP_PROBE_CACHE" in env:
        if not env["OVERLAP_PROBE_CACHE"].strip():
            raise ValueError(f"OVERLAP_PROBE_CACHE='' is invalid; accepted values: {ENV_VARS['OVERLAP_PROBE_CACHE'][0]}")
        fields["probe_cache"] = env["OVERLAP_PROBE_CACHE"].strip()
    if "OVERLAP_SHARDING" in env:
        fields["sharding"] = _parse_choice("OVERLAP_SHARDING", env["OVERLAP_SHARDING"], SHARDING_CHOICES)
    if "OVERLAP_COMPRESS" in env:
        fields["compress"] = _parse_choice("OVERLAP_COMPRESS", env["OVERLAP_COMPRESS"], COMPRESS_CHOICES)
    if "OVERLAP_COMPRESS_BLOCK" in env:
        fields["compress_block"] = _parse_block(env["OVERLAP_COMPRESS_BLOCK"])
    if "OVERLAP_ORDER_CHECK" in env:
        fields["order_check"] = _parse_choice("OVERLAP_ORDER_CHECK", env["OVERLAP_ORDER_CHECK"], ORDER_CHECKS)
    for name, field in (("OVERLAP_HOST_GBPS", "host_gbps"), ("OVERLAP_DISK_GBPS", "disk_gbps")):
        if name in env:
            fields[field] = _parse_auto_number(name, env[name], integer=False, minimum=0, strict=True)
    if "OVERLAP_COMPILE" in env:
        fields["compile"] = _parse_flag("OVERLAP_COMPILE", env["OVERLAP_COMPILE"])
    if "OVERLAP_OFFLOAD" in env:
        fields["offload"] = _parse_choice("OVERLAP_OFFLOAD", env["OVERLAP_OFFLOAD"], OFFLOAD_CHOICES)
    if "OVERLAP_DISK_WINDOW_MB" in env:
        fields["disk_window_mb"] = _parse_auto_number("OVERLAP_DISK_WINDOW_MB", env["OVERLAP_DISK_WINDOW_MB"],
                                                      integer=False, minimum=0, strict=False)
    if "OVERLAP_EXPERT_CHUNKS" in env:
        fields["expert_chunks"] = _parse_auto_number("OVERLAP_EXPERT_CHUNKS", env["OVERLAP_EXPERT_CHUNKS"],
                                                     integer=True, minimum=1, strict=False)
    if "OVERLAP_OFFLOAD_DIR" in env:
        if not env["OVERLAP_OFFLOAD_DIR"].strip():
            raise ValueError(f"OVERLAP_OFFLOAD_DIR='' is invalid; accepted values: {ENV_VARS['OVERLAP_OFFLOAD_DIR'][0]}")
        fields["offload_dir"] = env["OVERLAP_OFFLOAD_DIR"].strip()
    config = Config(**fields)
    if config.log_level is not None:
        logging.getLogger("overlap").setLevel(config.log_level)
    return config
