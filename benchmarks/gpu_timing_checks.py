"""Timing checks on one device: a slow link emulated by sleeps on the collectives' streams (the
exposed share of the injected time against the overlap report's, beside FSDP2's), and the step
time and peak memory of ShardedModule, FSDP2 and the plain model on a ~1B-parameter GPT.
"""
from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Callable, Optional

import torch

from common import device_seconds
from gpu_harness import (Checks, Injection, all_finite, bf16, collectives_issued_alone, device_for, empty_cache,
                         flush_record, lm_step, one_rank_on, timed_steps, token_batches)
from peers import shard_by_block

if TYPE_CHECKING:
    from overlap.models import GPTConfig

OVERHEAD_STEPS, OVERHEAD_WARMUP = 8, 3
# The emulated link moves ShardedModule's bytes of a step in this share of its uninjected step.
LINK_LOAD = 0.5
SLOW_WARMUP, SLOW_STEPS = 4, 10
# The report's added exposed time must match the step time's within this share of the injected
# time plus EXPOSED_SLACK_S (a few µs per wait of hand-over between streams show on one side only).
EXPOSED_TOLERANCE, EXPOSED_SLACK_S = 0.25, 0.5e-3


def sleep_rate(device: torch.device) -> float:
    """`torch.cuda._sleep` cycles per second, measured (it counts SM clock cycles, which boost)."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)
    return cycles / device_seconds(lambda: torch.cuda._sleep(cycles), device)


def _gpt_config(rehearse: bool, large: bool) -> "GPTConfig":
    from overlap.models import GPTConfig

    if rehearse:
        return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
    if large:
        return GPTConfig(vocab_size=32768, block_size=1024, n_layer=18, n_head=16, n_embd=2048)
    return GPTConfig(vocab_size=8192, block_size=512, n_layer=8, n_head=8, n_embd=1024)


def _wrapped_model(kind: str, config: "GPTConfig", device: torch.device, prefetch_depth: Optional[int] = None
             ) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """The GPT of `config` built on `device`, wrapped as `kind` ("overlap", "fsdp2" or "plain"),
    computing in bf16 with fp32 masters; and the context each forward runs in."""
    from overlap import ShardedModule
    from overlap.models import GPT, Block

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    if kind == "overlap":
        wrapped = ShardedModule(model, unit_types=(Block,), mixed_precision=bf16(), prefetch_depth=prefetch_depth)
        return wrapped, contextlib.nullcontext
    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return shard_by_block(fully_shard, model, mp_policy=policy), contextlib.nullcontext
    return model, lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _emulated_run(kind: str, config, device: torch.device, injection: Injection, warmup: int, steps: int) -> dict:
    """`warmup` + `steps` SGD steps of `kind` under `injection`, counted from the window on."""
    with collectives_issued_alone():                     # one device: the collectives to delay
        model, context = _wrapped_model(kind, config, device, prefetch_depth=1 if kind == "overlap" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batches = token_batches(device, warmup + steps, config.vocab_size, (8, config.block_size))
    step = lm_step(model, optimizer, batches, context)
    with injection.active():
        seconds, losses = timed_steps(step, device, warmup, steps, at_window=injection.reset)
    result = dict(step_s=statistics.median(seconds), finite=all_finite(losses), calls=Counter(injection.calls),
                  bytes_per_step=sum(injection.nbytes.values()) / steps,
                  slept_per_step={k: v / steps for k, v in injection.slept.items()})
    if kind == "overlap":
        flush_record(model)                                    # the window's last step
        window = model.overlap_report().steps[-steps:]
        result["window"] = [s.step for s in window]
        result["hidden"] = sum(s.hidden_s for s in window) / max(sum(s.comm_s for s in window), 1e-12)
        result["exposed_s"] = statistics.mean(s.exposed_s for s in window)
    del model, optimizer
    empty_cache(device)
    return result


def check_slow_link(checks: Checks, rehearse: bool) -> None:
    """Each collective's bytes over an emulated link, as a sleep before it on its stream: the share
    of the injected time the step time shows (ShardedModule's against its report's; FSDP2's)."""
    device = device_for(rehearse)
    config = _gpt_config(rehearse, large=False)
    warmup, steps = (2, 3) if rehearse else (SLOW_WARMUP, SLOW_STEPS)
    try:
        with one_rank_on(device):
            rate = sleep_rate(device) if device.type == "cuda" else 0.0
            runs = {("overlap", "plain"): _emulated_run("overlap", config, device, Injection(), warmup, steps)}
            base = runs[("overlap", "plain")]
            bandwidth = base["bytes_per_step"] / (LINK_LOAD * base["step_s"])    # bytes per second

            def cycles(kind: str, nbytes: int) -> int:
                return round(nbytes / bandwidth * rate)

            runs[("overlap", "slow")] = _emulated_run("overlap", config, device, Injection(cycles), warmup, steps)
            runs[("fsdp2", "plain")] = _emulated_run("fsdp2", config, device, Injection(), warmup, steps)
            # FSDP2 may copy its shard in place at one rank, calling no collective to delay.
            if sum(runs[("fsdp2", "plain")]["calls"].values()):
                runs[("fsdp2", "slow")] = _emulated_run("fsdp2", config, device, Injection(cycles), warmup, steps)
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check
        checks.error("slow_link", exc)
        return
    print(f"      GPT {config.num_params / 1e6:.1f}M parameters, batch 8 x {config.block_size}, bf16; emulated link "
          f"{bandwidth / 1e9:.3f} GB/s (ShardedModule's {base['bytes_per_step'] / 2**20:.1f} MB/step in "
          f"{LINK_LOAD:.0%} of its {base['step_s'] * 1e3:.1f} ms step)"
          + (f", sleep kernel at {rate / 1e9:.2f} GHz" if rate else ", no sleep kernel on CPU"))
    exposed = {}
    for kind, label in (("overlap", "ShardedModule"), ("fsdp2", "FSDP2")):
        plain, slow = runs[(kind, "plain")], runs.get((kind, "slow"))
        if slow is None:
            print(f"      {label:<14} step {plain['step_s'] * 1e3:7.1f} ms; no collective at world size 1 "
                  "(it copies its shard in place): nothing to delay")
            continue
        injected_s = sum(slow["slept_per_step"].values()) / rate if rate else 0.0
        exposed[kind] = (slow["step_s"] - plain["step_s"]) / injected_s if injected_s else math.nan
        parts = ", ".join(f"{k} {v / rate * 1e3:.2f}" for k, v in slow["slept_per_step"].items() if v) if rate else ""
        print(f"      {label:<14} step {plain['step_s'] * 1e3:7.1f} -> {slow['step_s'] * 1e3:7.1f} ms; injected "
              f"{injected_s * 1e3:.2f} ms/step ({parts or 'nothing'}); collectives per window {dict(slow['calls'])}; "
              f"exposed {exposed[kind]:.0%} of the injected time")
    fsdp = (f"FSDP2 exposed {exposed['fsdp2']:.0%}" if "fsdp2" in exposed else
            "FSDP2 calls no collective at world size 1, so no figure for it")
    finite = all(run["finite"] for run in runs.values())
    ours_plain, ours_slow = runs[("overlap", "plain")], runs[("overlap", "slow")]
    expected = list(range(warmup + 1, warmup + steps + 1))
    if ours_plain["window"] != expected or ours_slow["window"] != expected:
        checks.report("FAIL", "slow_link", f"the report's window covers steps {ours_slow['window']}, the timed "
                                           f"steps are {expected}")
        return
    if not finite or not ours_slow["calls"]["all_gather"]:
        checks.report("FAIL", "slow_link", f"finite: {finite}; the injection saw {dict(ours_slow['calls'])} of "
                                           "ShardedModule's collectives")
        return
    if not rate:
        checks.report("SKIP", "slow_link", f"no sleep kernel on CPU, so nothing was injected; the injection saw "
                                           f"ShardedModule's {dict(ours_slow['calls'])} per window; {fsdp}")
        return
    injected_s = sum(ours_slow["slept_per_step"].values()) / rate
    added_s = ours_slow["step_s"] - ours_plain["step_s"]
    report_added_s = ours_slow["exposed_s"] - ours_plain["exposed_s"]
    ok = abs(added_s - report_added_s) <= EXPOSED_TOLERANCE * injected_s + EXPOSED_SLACK_S
    checks.verdict("slow_link", ok,
                   f"ShardedModule exposed {exposed['overlap']:.0%} of the injected communication by step time "
                   f"(+{added_s * 1e3:.2f} ms); its report: {ours_slow['hidden']:.0%} hidden, exposed time "
                   f"+{report_added_s * 1e3:.2f} ms (pass within {EXPOSED_TOLERANCE:.0%} of the injected "
                   f"{injected_s * 1e3:.2f} ms + {EXPOSED_SLACK_S * 1e3:.1f} ms); {fsdp}")


def check_overhead(checks: Checks, rehearse: bool) -> None:
    device = device_for(rehearse)
    config = _gpt_config(rehearse, large=True)
    batch = 2 if rehearse else 8
    data = token_batches(device, OVERHEAD_STEPS + OVERHEAD_WARMUP, config.vocab_size, (batch, config.block_size))
    results = {}
    with one_rank_on(device):
        for kind in ("plain", "fsdp2", "overlap"):
            with checks.guarded(f"overhead[{kind}]"):
                model, context = _wrapped_model(kind, config, device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                step = lm_step(model, optimizer, data, context)
                seconds, losses = timed_steps(step, device, OVERHEAD_WARMUP, OVERHEAD_STEPS)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                results[kind] = dict(step_ms=1e3 * statistics.median(seconds), peak_gib=peak / 2**30,
                                     finite=all_finite(losses), last_loss=losses[-1])
                del model, optimizer
                empty_cache(device)
    if len(results) < 3:
        return
    print(f"      GPT {config.num_params / 1e9:.2f}B parameters, batch {batch} x {config.block_size}, bf16 compute, "
          f"fp32 master weights and AdamW")
    for kind, r in results.items():
        print(f"      {kind:<8} step {r['step_ms']:8.1f} ms   peak {r['peak_gib']:6.2f} GiB   last loss "
              f"{r['last_loss']:.4f}")
    ratio = results["overlap"]["step_ms"] / results["fsdp2"]["step_ms"]
    memory = results["overlap"]["peak_gib"] / max(results["fsdp2"]["peak_gib"], 1e-9)
    finite = all(r["finite"] for r in results.values())
    detail = (f"ShardedModule / FSDP2 step time {ratio:.3f} (pass at <= 1.15), / plain "
              f"{results['overlap']['step_ms'] / results['plain']['step_ms']:.3f}; peak memory / FSDP2 {memory:.3f}; "
              f"finite: {finite}")
    if rehearse:
        checks.report("SKIP" if finite else "FAIL", "overhead", f"CPU times in a rehearsal say nothing of the GPU's: "
                                                                f"{detail}")
        return
    checks.verdict("overhead", finite and ratio <= 1.15, detail)
