"""Parity checks on one device: ShardedModule trained plainly and with races injected on its
streams gives the same bits, stays finite and equals the unsharded model (the parity
configurations, compressed collectives, hybrid and hpZ, under torch's CUDA sanitizer); and
where `init_process_group`'s forms put the shards.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from common import patched
from gpu_harness import (Checks, deterministic, device_for, finite_run, identical_runs, one_rank_group, one_rank_on,
                         parity_configs, race_injection, small_gpt, synchronize, train_plain, train_sharded,
                         worst_parameter)


# Compressed losses against uncompressed (the CPU suite measures 0.55%: this checks the GPU path).
COMPRESSED_LOSS_RTOL = 0.02


def check_parity(checks: Checks, rehearse: bool) -> None:
    device = device_for(rehearse)
    with one_rank_on(device), deterministic():
        for name, config in parity_configs().items():
            runs = checks.attempt(f"parity[{name}]", lambda: (train_sharded(config, device, None), train_sharded(
                config, device, race_injection(rehearse)), train_plain(config, device)))
            if runs is None:
                continue
            plain, poked, reference = runs
            identical, finite = identical_runs(plain, poked), finite_run(poked)
            tol = dict(rtol=2e-2, atol=2e-3) if config.get("param_dtype") is not None else dict(rtol=1e-4, atol=1e-5)
            worst = worst_parameter(plain, reference, **tol)
            losses_close = all(math.isclose(a, b, rel_tol=tol["rtol"], abs_tol=tol["atol"])
                               for a, b in zip(plain["losses"], reference["losses"]))
            flat = {run: max(r["allocated"][1:]) - min(r["allocated"][1:]) for run, r in
                    (("plain", plain), ("injected", poked))}
            ok = identical and finite and worst <= 1.0 and losses_close and not any(flat.values())
            checks.verdict(f"parity[{name}]", ok,
                           f"plain == injected: {identical}; finite: {finite}; vs unsharded: losses "
                           f"{'close' if losses_close else 'DIFFER'}, worst parameter at {worst:.2f} of the "
                           f"tolerance; allocated bytes moved from step 2 on by {flat['plain']} (plain) / "
                           f"{flat['injected']} (injected); losses {['%.5f' % v for v in plain['losses']]}")


def check_compressed(checks: Checks, rehearse: bool) -> None:
    from overlap.base.choices import COMPRESSION_MODES

    device = device_for(rehearse)
    uncompressed: Optional[dict] = None        # losses and gathered bytes of mode "none"
    with one_rank_on(device), deterministic():
        for mode in COMPRESSION_MODES:
            name = f"compressed[{mode}]"
            config = dict(build=small_gpt, wrap=dict(prefetch_depth=1, compression=mode))
            injection = race_injection(rehearse)
            runs = checks.attempt(name, lambda: (train_sharded(config, device, None),
                                                 train_sharded(config, device, injection)))
            if runs is None:
                continue
            plain, poked = runs
            if mode == "none":
                uncompressed = dict(losses=plain["losses"], gather_bytes=injection.nbytes["all_gather"])
            recorded, seen = poked["recorded"], injection.calls
            gathers, reductions = recorded["all_gather"], recorded["reduce_scatter"]
            reductions_seen = seen["reduce_scatter"] + seen["all_to_all"]
            every_one_seen = seen["all_gather"] == gathers > 0 and reductions_seen == reductions
            coded = recorded["all_gather compressed"]
            coded_ok = coded == (0 if mode == "none" else gathers)
            if uncompressed is None:
                worst, bytes_share = math.inf, math.nan
            else:
                worst = max(abs(a - b) / abs(b) for a, b in zip(plain["losses"], uncompressed["losses"]))
                bytes_share = injection.nbytes["all_gather"] / max(uncompressed["gather_bytes"], 1)
            identical, finite = identical_runs(plain, poked), finite_run(poked) and finite_run(plain)
            ok = identical and finite and every_one_seen and coded_ok and worst <= COMPRESSED_LOSS_RTOL
            checks.verdict(name, ok,
                           f"plain == injected: {identical}; finite: {finite}; the injection saw {seen['all_gather']}"
                           f"/{gathers} gathers and {reductions_seen}/{reductions} reductions of the step records; "
                           f"{coded}/{gathers} gathers compressed on the wire, gathered bytes {bytes_share:.3f} of "
                           f"uncompressed; losses vs uncompressed within {worst:.3%} (pass at <= "
                           f"{COMPRESSED_LOSS_RTOL:.0%}): {['%.5f' % v for v in plain['losses']]}")


@contextlib.contextmanager
def second_level_of_one(kind: str, device: torch.device) -> Iterator[None]:
    """ShardedModules built inside get a second group of this one rank: hybrid's replicate group
    or hpZ's node group, which `resolve_sharding` builds for no single rank; with collectives
    issued as if not alone, it runs their streams, events and buffers as several nodes would."""
    from overlap.control import startup
    from overlap.runtime.mesh import ShardingGroups, connect

    second = dist.new_group([0])
    connect(second, device.type)
    resolve = startup.resolve_sharding

    def with_second_level(*args: Any, **kwargs: Any) -> ShardingGroups:
        groups = resolve(*args, **kwargs)
        if kind == "hybrid":
            return ShardingGroups(groups.shard, second)
        return ShardingGroups(groups.shard, None, second)

    with patched((startup, "resolve_sharding", with_second_level)):
        yield


def check_second_level(checks: Checks, rehearse: bool, kind: str) -> None:
    """A GPT sharded as `kind` (`second_level_of_one`) plainly and under the race injection:
    bit-identical, finite, equal to the unsharded model, the second level issued every step."""
    from overlap.runtime.node_copy import NodeCopy

    device = device_for(rehearse)
    config = parity_configs()["gpt_fp32_depth2"]
    # Backward's gathers from the node copy, counted (hpZ's second level).
    from_copies = Counter()
    gather = NodeCopy.gather

    def counted_gather(copy: NodeCopy, *args: Any, **kwargs: Any) -> Any:
        from_copies["gathers"] += 1
        from_copies["from the node copy"] += copy.secondary is not None
        return gather(copy, *args, **kwargs)

    try:
        with patched((NodeCopy, "gather", counted_gather)), one_rank_on(device), deterministic(), \
                second_level_of_one(kind, device):
            plain = train_sharded(config, device, None)
            injection = race_injection(rehearse)
            from_copies.clear()
            poked = train_sharded(config, device, injection)
        reference = train_plain(config, device)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error(kind, exc)
        return
    identical, finite = identical_runs(plain, poked), finite_run(poked)
    worst = worst_parameter(plain, reference, rtol=1e-4, atol=1e-5)
    steps = len(plain["losses"])
    if kind == "hybrid":
        extra = poked["recorded"]["all_reduce"]
        issued = extra >= steps and injection.calls["all_reduce"] >= extra
        what = f"{extra} all-reduces across replicas in {steps} steps ({injection.calls['all_reduce']} seen by the " \
               f"injection)"
    else:
        extra = from_copies["from the node copy"]
        issued = extra >= steps
        what = f"{extra} of {from_copies['gathers']} gathers from the node copy in {steps} steps"
    ok = identical and finite and worst <= 1.0 and issued
    checks.verdict(kind, ok, f"{what}; plain == injected: {identical}; finite: {finite}; worst parameter against "
                             f"the unsharded model at {worst:.2f} of rtol 1e-4 + atol 1e-5; "
                             f"losses {['%.5f' % v for v in plain['losses']]}")


SANITIZED_STEPS = 2


def check_sanitized(checks: Checks, rehearse: bool) -> None:
    """Two parity steps, plain and injected, under TORCH_CUDA_SANITIZER=1 (set by gpu_check.sh):
    it raises on cross-stream use without an event, or memory freed while a stream reads it."""
    from torch.cuda._sanitizer import cuda_sanitizer

    device = device_for(rehearse)
    config = parity_configs()["gpt_fp32_depth2"]
    active = device.type == "cuda" and cuda_sanitizer is not None and cuda_sanitizer.enabled
    try:
        with one_rank_on(device), deterministic():
            plain = train_sharded(config, device, None, SANITIZED_STEPS)
            poked = train_sharded(config, device, race_injection(rehearse), SANITIZED_STEPS)
    except Exception as exc:  # noqa: BLE001 - a sanitizer's report is an exception: a failed check
        checks.error("sanitized", exc)
        return
    identical, finite = identical_runs(plain, poked), finite_run(poked)
    detail = (f"{SANITIZED_STEPS} steps plain and injected: no unsynchronised cross-stream use reported; "
              f"plain == injected: {identical}; finite: {finite}")
    if not active:
        checks.report("SKIP" if identical and finite else "FAIL", "sanitized",
                      f"the sanitizer tracks CUDA streams and TORCH_CUDA_SANITIZER=1 was "
                      f"{'set' if os.environ.get('TORCH_CUDA_SANITIZER') else 'not set'}; the steps ran: {detail}")
        return
    checks.verdict("sanitized", identical and finite, detail)


def check_device(checks: Checks, rehearse: bool) -> None:
    from overlap import ShardedModule

    forms = {"init_process_group()": None, "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl", "nccl": "nccl"}
    if rehearse:
        forms = {"init_process_group()": None, "gloo": "gloo"}
    expected = device_for(rehearse)
    for label, backend in forms.items():
        with checks.guarded(f"device[{label}]"), one_rank_group(backend):
            if expected.type == "cuda":
                torch.cuda.set_device(expected)
            model = ShardedModule(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
            model(torch.randn(4, 64, device=expected)).sum().backward()
            synchronize(expected)
            got = model.collectives.device
            grads_on = {p.grad.device for p in model.parameters() if p.grad is not None}
            checks.verdict(f"device[{label}]", got == expected and grads_on == {expected},
                           f"shards on {got}, gradients on {sorted(map(str, grads_on))}, expected {expected}")
