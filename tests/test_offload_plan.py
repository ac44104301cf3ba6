"""The offload tiers' arithmetic (overlap.plan.offload) against cases computed by hand, and
`overlap estimate` / `overlap simulate --offload` printing them."""
from __future__ import annotations

import pytest

from overlap.base.config import config_from_env
from overlap.cli import estimate, simulate
from overlap.plan.links import TIER_LINK_DEFAULTS, LinkModel
from overlap.plan.offload import TierRates, offload_time, rates_with, tier_bytes

PSI, N = 8e9, 8        # 1e9 parameters per rank
SHARD = PSI / N


def _tiers(b) -> tuple[float, float, float]:
    return (b.device, b.host, b.disk)


def test_bytes_per_tier_mixed_precision_adam():
    # master 4 + gradient 4 + two moments 8 = 16 bytes per parameter of the shard.
    assert _tiers(tier_bytes("none", PSI, N)) == pytest.approx((16 * SHARD, 0, 0))
    # The device keeps the bf16 shard the all-gather sends (2 bytes); the host all 16.
    assert _tiers(tier_bytes("cpu", PSI, N, "bf16")) == pytest.approx((2 * SHARD, 16 * SHARD, 0))
    # Disk: master and moments (12); the host the bf16 shard the step writes (2), the
    # gradient (4) and 3 buffers of a bucket of 1e6 parameters x 12 bytes.
    b = tier_bytes("disk", PSI, N, "bf16", bucket_params=1e6, buffers=3)
    # The state file holds each bucket twice: current and spare slots.
    assert (b.device, b.host, b.disk) == pytest.approx((2 * SHARD, 6 * SHARD + 3 * 12e6, 2 * 12 * SHARD))


def test_bytes_per_tier_fp32_and_sgd():
    # fp32: the master shard itself is sent, so nothing stays on the device between steps.
    assert tier_bytes("cpu", PSI, N, "fp32", "adamw").device == 0
    # Plain SGD has no moments: 8 bytes per parameter, disk holds only the master.
    assert _tiers(tier_bytes("cpu", PSI, N, "fp16", "sgd")) == pytest.approx((2 * SHARD, 8 * SHARD, 0))
    assert tier_bytes("disk", PSI, N, "fp16", "sgd", bucket_params=1e6).disk == pytest.approx(2 * 4 * SHARD)
    # A shard smaller than a bucket needs buffers of the shard only.
    small = tier_bytes("disk", 1e6, 1, "bf16", "adamw", bucket_params=1e8, buffers=3)
    assert small.host == pytest.approx(2e6 + 4e6 + 3 * 12e6)


def test_time_per_step_by_hand():
    rates = TierRates(LinkModel("host", 0.0, 20e9), LinkModel("disk", 0.0, 2e9), update_params_per_s=0.5e9)
    # cpu: gradient 4 GB down + bf16 shard 2 GB up at 20 GB/s = 0.3 s; update 1e9 / 0.5e9 = 2 s.
    t = offload_time("cpu", PSI, N, "bf16", rates=rates)
    assert (t.copy_s, t.update_s, t.io_s) == pytest.approx((0.3, 2.0, 0.0))
    assert (t.extra_s, t.floor_s) == pytest.approx((2.3, 2.0))
    # disk: 12 GB read + 12 GB written at 2 GB/s = 12 s, which the 2 s update hides under.
    t = offload_time("disk", PSI, N, "bf16", rates=rates)
    assert t.io_s == pytest.approx(12.0) and t.extra_s == pytest.approx(12.3) and t.floor_s == pytest.approx(12.0)
    # fp32 sends the 4-byte master back up: 4 + 4 GB.
    assert offload_time("cpu", PSI, N, "fp32", rates=rates).copy_s == pytest.approx(0.4)
    assert offload_time("none", PSI, N).extra_s == 0


def test_latency_counts_per_copy_and_request():
    rates = TierRates(LinkModel("host", 1e-3, 1e30), LinkModel("disk", 1e-2, 1e30), update_params_per_s=1e30)
    # One copy each way per unit; one read and one write per bucket (ceil(1e9 / 4e8) = 3).
    assert offload_time("cpu", PSI, N, rates=rates, units=32).copy_s == pytest.approx(64e-3)
    assert offload_time("disk", PSI, N, rates=rates, bucket_params=4e8).io_s == pytest.approx(6e-2)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="offload"):
        tier_bytes("nvme", PSI, N)
    with pytest.raises(ValueError, match="precision"):
        offload_time("cpu", PSI, N, "int8")
    with pytest.raises(ValueError, match="host_gbps"):
        rates_with(host_gbps=0)


def test_rates_overrides_replace_only_bandwidth():
    rates = rates_with(host_gbps=50, disk_gbps=1.5, update_params_per_s=3e8)
    assert rates.host.beta == 50e9 and rates.host.alpha == TIER_LINK_DEFAULTS["host"].alpha
    assert rates.disk.beta == 1.5e9 and rates.update_params_per_s == 3e8
    assert rates_with() == TierRates()


def test_env_variables_are_read_by_the_config():
    assert config_from_env({"OVERLAP_HOST_GBPS": "12.5", "OVERLAP_DISK_GBPS": "auto"}).host_gbps == 12.5
    assert config_from_env({"OVERLAP_DISK_GBPS": "auto"}).disk_gbps is None
    with pytest.raises(ValueError, match="OVERLAP_DISK_GBPS"):
        config_from_env({"OVERLAP_DISK_GBPS": "-1"})


def test_estimate_prints_every_tier_and_the_added_time(capsys, monkeypatch):
    monkeypatch.setenv("OVERLAP_HOST_GBPS", "10")      # the flag below must win over it
    assert estimate.main(["--params", "8e9", "--world", "8", "--offload", "disk", "--host-gbps", "20",
                          "--disk-gbps", "2", "--cpu-update-rate", "5e8", "--disk-bucket", "1e6"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-3:] for line in out.splitlines()
            if line.split() and line.split()[0] in ("none", "cpu", "disk")}
    assert rows["none"] == ["16.00", "0.00", "0.00"]
    assert rows["cpu"] == ["2.00", "16.00", "0.00"]
    assert rows["disk"] == ["2.00", "6.04", "24.00"]       # the state file holds two slots
    assert "copies 300.0 ms" in out and "at 20 GB/s" in out and "CPU AdamW 2,000.0 ms" in out
    # 2 x 1000 requests of 100 µs on top of the 12 s of bandwidth.
    assert "disk IO 12,200.0 ms at 2 GB/s" in out and "-> 12,500.0 ms" in out


def test_estimate_takes_the_host_bandwidth_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("OVERLAP_HOST_GBPS", "10")
    assert estimate.main(["--params", "8e9", "--world", "8", "--offload", "cpu"]) == 0
    assert "copies 600.0 ms over the host link at 10 GB/s" in capsys.readouterr().out


def test_estimate_without_offload_prints_no_tiers(capsys):
    assert estimate.main(["--params", "8e9", "--world", "8"]) == 0
    assert "offload" not in capsys.readouterr().out


def test_estimate_refuses_offload_outside_zero3(capsys):
    with pytest.raises(SystemExit):
        estimate.main(["--params", "8e9", "--world", "8", "--stage", "zero1", "--offload", "cpu"])
    assert "--stage zero3" in capsys.readouterr().err


def test_simulate_adds_the_offload_time_to_the_planned_step(capsys):
    argv = ["--model", "gpt2", "--cluster", "8xH100-nvlink"]
    assert simulate.main(argv + ["--offload", "cpu", "--cpu-update-rate", "1e9"]) == 0
    out = capsys.readouterr().out
    pick = next(line for line in out.splitlines() if line.startswith("planner pick:"))
    step_ms = float(pick.split("-> step ")[1].split(" ms")[0])
    with_offload = next(line for line in out.splitlines() if line.startswith("planner pick with offload cpu"))
    model = simulate.MODELS["gpt2"]
    t = offload_time("cpu", model.params, 8, "bf16", "adamw", TierRates(), model.layers)
    assert float(with_offload.split("step ")[1].split(" ms")[0].replace(",", "")) == pytest.approx(
        step_ms + t.extra_s * 1e3, abs=0.2)
