"""The GPU check runs clean where there is no GPU: benchmarks/gpu_checks.py's rehearsal (its
checks on CPU with gloo and tiny sizes) gives every check a PASS or a SKIP with its reason,
and benchmarks/gpu_check.sh, whose caps fit its budget, SKIPs every step with a reason."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gpu_checks import CHECKS  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
VERDICT = re.compile(r"^(PASS|FAIL|SKIP) ([\w\[\]().,:=\- ]+?): (.*)$")


def _verdicts(output: str) -> list[tuple[str, str, str]]:
    """(status, check, detail) of every verdict line."""
    return [m.groups() for m in map(VERDICT.match, output.splitlines()) if m]


def _check_of(name: str) -> str:
    """`parity[no_sync]` -> `parity`."""
    return name.split("[", 1)[0]


@pytest.mark.slow          # every GPU check rehearsed on CPU (about 25 s under CI's load): in `make test-all`
@pytest.mark.timeout(330)
def test_rehearsal_gives_every_check_a_pass_or_a_skip_with_its_reason():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_checks.py"), "--rehearse"],
                          env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    verdicts = _verdicts(proc.stdout)
    failed = [v for v in verdicts if v[0] == "FAIL"]
    assert not failed, failed
    assert {_check_of(name) for _, name, _ in verdicts} == set(CHECKS), output[-4000:]
    for status, name, detail in verdicts:
        assert status in ("PASS", "SKIP") and detail.strip(), (status, name, detail)
    # The checks of the newest code ran their CPU half, not just a SKIP.
    passed = {_check_of(name) for status, name, _ in verdicts if status == "PASS"}
    assert {"compressed", "device", "parity", "large_index", "hybrid", "hpz"} <= passed, verdicts
    # The injection reached the compressed gathers and every reduction the step records hold.
    for status, name, detail in verdicts:
        if name.startswith("compressed["):
            seen = re.search(r"saw (\d+)/(\d+) gathers and (\d+)/(\d+) reductions", detail)
            assert seen and seen[1] == seen[2] != "0" and seen[3] == seen[4], detail


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs for real (minutes)")
@pytest.mark.timeout(150)
def test_script_without_a_gpu_prints_its_plan_and_skips_every_step_with_a_reason(tmp_path):
    env = {**ENV, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    budget = int(re.search(r"^plan: step, cap \(budget (\d+) s\)", proc.stdout, re.M)[1])
    caps = dict(re.findall(r"^  (\w+) +(\d+) s$", proc.stdout, re.M))
    total = int(caps.pop("total"))
    assert total == sum(map(int, caps.values())) <= budget <= 480, caps
    verdicts = _verdicts(proc.stdout)
    assert verdicts and all(status == "SKIP" and detail.strip() for status, _, detail in verdicts), verdicts
    skipped = {_check_of(name) for _, name, _ in verdicts}
    steps = set(caps) - {"machine", "compressed", "report_timing", "sync_free", "two_level", "slow_link", "parity",
                         "sanitized", "large_index", "overhead"}
    assert skipped == steps | set(CHECKS), skipped ^ (steps | set(CHECKS))
    assert re.search(rf"^0 passed, 0 failed, {len(verdicts)} skipped; status 0", proc.stdout, re.M), output[-2000:]
