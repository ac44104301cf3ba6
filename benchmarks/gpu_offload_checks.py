"""offload="cpu" and "disk" on one device: parity against offload="none" under injected races,
the host<->device copies' bandwidth and overlap with compute, the disk tier's 16-bit refresh.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from common import device_seconds
from gpu_harness import Checks, all_finite, bf16, device_for, one_rank_on, race_injection, small_gpt, train_sharded

OFFLOAD_COPY_NUMEL = 64 * 2**20          # 256 MiB a copy: several ms, launches do not count
OFFLOAD_RTOL = 1e-3                      # "cpu" and "disk" against "none": losses and parameters
# Shares of a plain pinned copy's bandwidth to reach, and of the copy to hide under compute.
OFFLOAD_BANDWIDTH_SHARE, OFFLOAD_HIDDEN_SHARE = 0.8, 0.5


def _runs_against_none(device: torch.device, offload: str, wrap: dict, optimizer: str) -> dict:
    """A GPT trained by `train_sharded` with offload "none" and with `offload` under the race
    injection, and where its parameters and gradients lived (device, pinned, dtype, grad device,
    grad dtype) and, for "disk", the gathered 16-bit shards. `optimizer`: "torch" or "overlap"'s AdamW."""
    from overlap.optim import AdamW

    optimizer_class = AdamW if optimizer == "overlap" else torch.optim.AdamW
    out = {}
    for mode in ("none", offload):
        seen: dict = {}

        def after_backward(model: torch.nn.Module) -> None:
            seen.update(model=model, places={(p.device.type, p.is_pinned(), str(p.dtype), p.grad.device.type,
                                              str(p.grad.dtype)) for p in model.parameters() if p.grad is not None})

        config = dict(build=small_gpt, wrap=dict(offload=mode, **wrap), after_backward=after_backward,
                      optimizer=lambda params: optimizer_class(params, lr=1e-3))
        run = train_sharded(config, device, race_injection(device.type != "cuda") if mode != "none" else None)
        groups = [g for unit in seen["model"].scheduler.all_units for g in unit.groups if g.place.offloaded]
        sent = {g.place.sent.device.type for g in groups} if mode == "disk" else None
        out[mode] = dict(run, places=seen["places"], sent=sent)
    return out


def _against_none(checks: Checks, device: torch.device, name: str, offload: str, wrap: dict,
                  optimizer: str) -> Optional[tuple[dict, dict, bool, bool]]:
    """`_runs_against_none`'s runs ("none"'s, `offload`'s) and whether the losses and the states
    are within OFFLOAD_RTOL; None after a FAIL of `name` if they raise."""
    runs = checks.attempt(name, lambda: _runs_against_none(device, offload, wrap, optimizer))
    if runs is None:
        return None
    ref, got = runs["none"], runs[offload]
    # "none" steps AdamW on the device, the others on the host: another order, so close, not equal.
    close = all(math.isclose(a, b, rel_tol=OFFLOAD_RTOL) for a, b in zip(ref["losses"], got["losses"]))
    states = all(torch.allclose(got["state"][k].float(), v.float(), rtol=OFFLOAD_RTOL, atol=1e-5)
                 for k, v in ref["state"].items())
    return ref, got, close, states


def _offload_parity(checks: Checks, device: torch.device) -> None:
    for name, wrap in (("fp32", {}), ("bf16", dict(mixed_precision=bf16()))):
        compared = _against_none(checks, device, f"offload[parity_{name}]", "cpu", wrap, "torch")
        if compared is None:
            continue
        ref, got, close, states = compared
        identical = ref["losses"] == got["losses"] and all(torch.equal(got["state"][k], v)
                                                            for k, v in ref["state"].items())
        pinned = torch.cuda.is_available()
        places = {(where, pinned_, grad_where) for where, pinned_, _, grad_where, _ in got["places"]}
        on_host = places == {("cpu", pinned, "cpu")}
        checks.verdict(f"offload[parity_{name}]", close and states and on_host and all_finite(got["losses"]),
                       f"offload=cpu (delays injected on the collectives' and the copies' streams) against none: "
                       f"identical {identical}, losses and parameters within {OFFLOAD_RTOL:g}: {close}, {states}; "
                       f"parameters and gradients (device, pinned, grad device): {sorted(places)}; "
                       f"losses {['%.5f' % v for v in got['losses']]}")


def _elapsed_ms(run: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of `run`, by events on the compute stream."""
    return 1e3 * min(device_seconds(run, device) for _ in range(repeats))


def _offload_copies(checks: Checks, device: torch.device) -> None:
    from overlap.kernels.backends import get_backend
    from overlap.runtime.host_tier import HostTier
    from overlap.runtime.pending import COMPLETED

    n = OFFLOAD_COPY_NUMEL
    nbytes = 4 * n
    gather_stream = torch.cuda.Stream(device=device, priority=-1)
    tier = HostTier(device, get_backend("auto", device), gather_stream)
    place = tier.place()
    master = place.place_master(torch.randn(n))
    grad_shard = place.zeros_like(master)
    device_buffer = torch.empty(n, device=device)
    compute = torch.cuda.current_stream(device)

    # `between` runs after the copy is queued, before the compute stream waits for it.
    def upload(between: Callable[[], None] = lambda: None) -> None:     # what a gather sends, as queued
        place.gather_source(master, torch.float32, encoded=False, local=False)
        between()
        compute.wait_stream(gather_stream)

    def download(between: Callable[[], None] = lambda: None, ready: bool = True) -> None:  # a gradient going home
        place.reduce_target(grad_shard, zeros=True)
        place.reduction_issued(COMPLETED)
        between()
        compute.wait_stream(tier.download_stream)
        if ready:
            place.grads_ready()

    plain_h2d = _elapsed_ms(lambda: device_buffer.copy_(master, non_blocking=True), device)
    plain_d2h = _elapsed_ms(lambda: grad_shard.copy_(device_buffer, non_blocking=True), device)
    ours_h2d, ours_d2h = _elapsed_ms(upload, device), _elapsed_ms(download, device)
    gbps = {name: nbytes / (ms * 1e-3) / 1e9 for name, ms in
            (("plain_h2d", plain_h2d), ("plain_d2h", plain_d2h), ("h2d", ours_h2d), ("d2h", ours_d2h))}
    shares = {"h2d": gbps["h2d"] / gbps["plain_h2d"], "d2h": gbps["d2h"] / gbps["plain_d2h"]}
    checks.verdict("offload[bandwidth]", min(shares.values()) >= OFFLOAD_BANDWIDTH_SHARE,
                   f"{nbytes / 2**20:.0f} MiB: host->device {gbps['h2d']:.1f} GB/s ({shares['h2d']:.2f} of a plain "
                   f"pinned copy's {gbps['plain_h2d']:.1f}), device->host {gbps['d2h']:.1f} GB/s ({shares['d2h']:.2f} of "
                   f"{gbps['plain_d2h']:.1f}); pass at >= {OFFLOAD_BANDWIDTH_SHARE} each")

    # Compute about three copies long: square bf16 matmuls on the compute stream.
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    one_ms = _elapsed_ms(lambda: a @ a, device)
    reps = max(1, int(3 * max(ours_h2d, ours_d2h) / max(one_ms, 1e-3)))

    def matmuls() -> None:
        for _ in range(reps):
            a @ a

    compute_ms = _elapsed_ms(matmuls, device)
    # The copy is queued first, the matmuls after it; the end waits for both.
    both = {"h2d": lambda: upload(matmuls), "d2h": lambda: download(matmuls, ready=False)}
    for name, copy_ms in (("h2d", ours_h2d), ("d2h", ours_d2h)):
        together_ms = _elapsed_ms(both[name], device)
        place.grads_ready()
        hidden = (compute_ms + copy_ms - together_ms) / copy_ms
        checks.verdict(f"offload[overlap_{name}]", hidden >= OFFLOAD_HIDDEN_SHARE,
                       f"copy {copy_ms:.2f} ms, compute {compute_ms:.2f} ms, both {together_ms:.2f} ms: "
                       f"{100 * hidden:.0f}% of the copy hidden (pass at >= {100 * OFFLOAD_HIDDEN_SHARE:.0f}%)")


# The refresh's share of a plain pinned copy's bandwidth (one copy per bucket: more launches).
DISK_REFRESH_SHARE = 0.7


def _disk_parity(checks: Checks, device: torch.device) -> None:
    compared = _against_none(checks, device, "offload[disk_parity_bf16]", "disk", dict(mixed_precision=bf16()),
                             "overlap")
    if compared is None:
        return
    ref, got, close, masters = compared
    identical = ref["losses"] == got["losses"]
    pinned = torch.cuda.is_available()
    places_ok = got["places"] == {("cpu", pinned, "torch.bfloat16", "cpu", "torch.float32")}
    sent_ok = bool(got["sent"]) and got["sent"] == {device.type}
    checks.verdict("offload[disk_parity_bf16]",
                   close and masters and places_ok and sent_ok and all_finite(got["losses"]),
                   f"offload=disk against none: identical losses {identical}, within 1e-3: {close}, fp32 masters "
                   f"within 1e-3: {masters}; parameters and gradients (device, pinned, dtype, grad device, grad "
                   f"dtype): {sorted(got['places'])}; gathered shards on {sorted(got['sent'])}; "
                   f"losses {['%.5f' % v for v in got['losses']]} (none: {['%.5f' % v for v in ref['losses']]})")


def _disk_refresh(checks: Checks, device: torch.device) -> None:
    """The 16-bit shard's refresh (one copy per bucket) against one plain pinned copy."""
    from overlap import ShardedModule
    from overlap.optim.paged import paged_of

    torch.manual_seed(0)
    model = ShardedModule(small_gpt(layers=4, width=512), offload="disk", mixed_precision=bf16())
    groups = [g for unit in model.scheduler.all_units for g in unit.groups if g.place.offloaded]
    engine = paged_of(next(model.parameters())).engine
    buckets = [(g.place, b) for g in groups for b in engine.buckets if b.shard == g.place.index]
    nbytes = sum(g.shard.nbytes for g in groups)
    compute = torch.cuda.current_stream(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def refresh() -> None:                 # every bucket, as a step queues them
        for place, bucket in buckets:
            place.bucket_written(bucket)
        for g in groups:
            if g.place.refreshed is not None:
                compute.wait_event(g.place.refreshed)

    plain_ms = _elapsed_ms(lambda: target.copy_(host, non_blocking=True), device)
    ours_ms = _elapsed_ms(refresh, device)
    equal = all(torch.equal(g.place.sent.cpu(), g.shard) for g in groups)
    plain, ours = nbytes / (plain_ms * 1e-3) / 1e9, nbytes / (ours_ms * 1e-3) / 1e9
    checks.verdict("offload[disk_refresh]", equal and ours / plain >= DISK_REFRESH_SHARE,
                   f"{nbytes / 2**20:.1f} MiB in {len(buckets)} bucket copies: host->device {ours:.1f} GB/s "
                   f"({ours / plain:.2f} of one plain pinned copy's {plain:.1f}); device shards equal the host's: "
                   f"{equal}; pass at >= {DISK_REFRESH_SHARE}")


def check_offload(checks: Checks, rehearse: bool) -> None:
    device = device_for(rehearse)
    with one_rank_on(device):
        _offload_parity(checks, device)
        _disk_parity(checks, device)
    if rehearse:
        for name in ("bandwidth", "overlap", "disk_refresh"):
            checks.report("SKIP", f"offload[{name}]", "CPU rehearsal: host and device are one memory, there is no "
                                                      "copy engine to measure or overlap")
        return
    with checks.guarded("offload[copies]"):
        _offload_copies(checks, device)
    with checks.guarded("offload[disk_refresh]"), one_rank_on(device):
        _disk_refresh(checks, device)
