"""Which link joins the GPUs of one host: NVLink or PCIe, as NVML (the driver's management
library) reports it between each pair of the ranks' GPUs.

CUDA cannot say it: `can_device_access_peer` is also true for peer access over PCIe, and a
process that sees one GPU (CUDA_VISIBLE_DEVICES set per rank) cannot ask about the others.
NVML sees every GPU of the host whatever CUDA_VISIBLE_DEVICES says, and names each by the
UUID that CUDA reports too. It is reached through ctypes, as `torch.cuda` itself does, so no
Python binding is needed; without it (no driver library, a MIG instance NVML does not
resolve) NVLink cannot be confirmed and the link is taken as PCIe, the slower guess.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Callable, Optional, Sequence

import torch

NVML_LIBRARY = "libnvidia-ml.so.1"
# nvml.h: nvmlGpuP2PCapsIndex_t NVML_P2P_CAPS_INDEX_NVLINK, nvmlGpuP2PStatus_t NVML_P2P_STATUS_OK.
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or asked (the message says which call failed)."""


def gpu_uuid(device: torch.device) -> Optional[str]:
    """This rank's GPU as NVML names it ("GPU-<uuid>"), None when the rank computes on CPU."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def nvml_pairs_without_nvlink(gpus: Sequence[str]) -> list[tuple[str, str]]:
    """The pairs of `gpus` (NVML UUIDs) that NVML reports no NVLink between; raises
    NvmlUnavailable when it cannot be asked."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        raise NvmlUnavailable(f"{NVML_LIBRARY} not loadable: {exc}") from None

    def call(name: str, *args) -> None:
        code = getattr(nvml, name)(*args)
        if code != 0:
            raise NvmlUnavailable(f"{name} returned NVML error {code}")

    call("nvmlInit_v2")
    try:
        handles = {}
        for gpu in gpus:
            handle = ctypes.c_void_p()
            call("nvmlDeviceGetHandleByUUID", gpu.encode(), ctypes.byref(handle))
            handles[gpu] = handle
        missing = []
        for a, b in itertools.combinations(gpus, 2):
            status = ctypes.c_int()
            call("nvmlDeviceGetP2PStatus", handles[a], handles[b], P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
            if status.value != P2P_STATUS_OK:
                missing.append((a, b))
        return missing
    finally:
        nvml.nvmlShutdown()


def host_link(gpus: Sequence[Optional[str]],
              pairs_without_nvlink: Callable[[Sequence[str]], list[tuple[str, str]]] = nvml_pairs_without_nvlink
              ) -> tuple[str, str]:
    """The link class joining one host's ranks, given each rank's GPU (`gpu_uuid`; None for
    a rank on CPU), and why: nvlink when NVML reports NVLink between every pair of their
    GPUs, pcie when it does not or cannot be asked, loopback when the ranks share host
    memory only (gloo on CPU) or one GPU."""
    if any(gpu is None for gpu in gpus):
        return "loopback", "ranks on CPU: gloo copies through host memory"
    distinct = sorted(set(gpus))
    if len(distinct) < 2:
        return "loopback", "one GPU: nothing crosses a link between GPUs"
    try:
        missing = pairs_without_nvlink(distinct)
    except NvmlUnavailable as exc:
        return "pcie", f"NVLink not confirmed, NVML unavailable ({exc}): taken as PCIe"
    if missing:
        a, b = missing[0]
        return "pcie", f"no NVLink between {a} and {b} (NVML; {len(missing)} of the pairs): PCIe"
    return "nvlink", f"NVLink between each pair of the {len(distinct)} GPUs (NVML)"
