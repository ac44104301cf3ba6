"""The framework examples run as their docstrings say, briefly: Lightning starts its own 2 CPU
ranks, the Hugging Face one runs under torchrun; each writes what it promises."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _run(command: list[str], cwd: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_lightning_example(tmp_path) -> None:
    pytest.importorskip("lightning")
    out = _run([sys.executable, os.path.join(EXAMPLES, "lightning_gpt.py"), "--steps", "4"], str(tmp_path))
    assert "after 4 steps" in out
    assert os.path.isdir(tmp_path / "lightning_gpt_out" / "last.ckpt")
    assert os.path.isfile(tmp_path / "lightning_gpt_out" / "gpt.pt")


@pytest.mark.timeout(300)
def test_hf_trainer_example(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                os.path.join(EXAMPLES, "hf_trainer.py"), "--steps", "4"], str(tmp_path))
    assert "reloaded with from_pretrained" in out
    assert os.path.isdir(tmp_path / "hf_trainer_out" / "checkpoint-2" / "overlap_sharded")
