"""Kill `overlap train`'s workers on the emulated two-node cluster (cluster.py) at chosen
points of one torchrun job, and measure how it recovers: whether every restart met again,
how long from the kill to the first step after the resume, and the final loss.

    python benchmarks/recovery.py --kills start,step,save --repeat 5

Kill points: `start` a worker after the first step of a round and before any checkpoint is
complete; `step` a worker at a random moment between checkpoints; `save` a worker as soon
as an asynchronous save has begun writing (its `.partial` directory exists); `node` node 1's
agent and worker together, for good (the job is elastic, `--nnodes 1:2`, and must finish on
node 0 alone). Kills alternate between the nodes. Needs root.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import NODES, Cluster, two_node_cluster     # noqa: E402

JOB = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2",
       "--eval-every", "7", "--bucket-mb", "1", "--prefetch-depth", "1"]
# Rendezvous settings for a test-sized job: a lost node is noticed within seconds, a round
# closes a second after enough nodes joined.
RDZV_CONF = ["last_call_timeout=1", "close_timeout=5", "heartbeat=2", "keep_alive_interval=1",
             "keep_alive_max_attempt=2"]
HEADER = re.compile(r"^overlap train: GPT .*$", re.M)
BAR = re.compile(r"train:\s+\d+%\|[^|]*\|\s*(\d+)/\d+ ")
RESUMED = re.compile(r"^resumed from \S+ at step (\d+)$", re.M)
FINAL = re.compile(r"^final step (\d+): loss ([\d.]+) .*, val loss ([\d.]+)$", re.M)
POLL_S = 0.01


@dataclass
class Kill:
    point: str                     # start | step | save | node
    node: int
    at_step: int = -1              # the bar's step when killed
    during_save: Optional[bool] = None  # save kills: the save was still incomplete afterwards
    recovered_s: Optional[float] = None  # kill -> first step of the next round (None: never)


@dataclass
class Outcome:
    kills: list[Kill]
    returncodes: list[Optional[int]]
    logs: list[str]
    final: Optional[tuple[int, float, float]] = None
    extra: dict = field(default_factory=dict)


class Job:
    """One torchrun job across the two nodes, its logs in files, and its workers."""

    def __init__(self, cluster: Cluster, workdir: str, argv: Sequence[str], nnodes: str, max_restarts: int,
                 python: str, env: dict) -> None:
        self.workdir = workdir
        self.checkpoints = os.path.join(workdir, "ckpt")
        self.log_paths = [os.path.join(workdir, f"node{node}.log") for node in range(NODES)]
        run_id = uuid.uuid4().hex
        self.agents = []
        for node in range(NODES):
            command = cluster.torchrun(node, 1, ["-m", "overlap", "train", *argv, "--checkpoint-dir",
                                                 self.checkpoints], python=python, run_id=run_id, nnodes=nnodes,
                                       max_restarts=max_restarts, rdzv_conf=RDZV_CONF)
            with open(self.log_paths[node], "w") as sink:
                self.agents.append(subprocess.Popen(command, cwd=workdir, env=env, stdout=sink,
                                                    stderr=subprocess.STDOUT, start_new_session=True))

    def log(self, node: int) -> str:
        with open(self.log_paths[node], errors="replace") as f:
            return f.read()

    def round_state(self) -> tuple[int, int]:
        """(rounds started, completed steps of the current round) from rank 0's output (node 0's:
        the rendezvous ranks nodes by address, and node 0 stays)."""
        text = self.log(0)
        headers = HEADER.findall(text)
        last = text.rsplit("overlap train: GPT ", 1)[-1] if headers else ""
        steps = [int(s) for s in BAR.findall(last)]
        resumed = RESUMED.findall(last)
        return len(headers), max(steps) if steps else (int(resumed[-1]) if resumed else 0)

    def worker(self, node: int) -> Optional[int]:
        agent = self.agents[node].pid
        for task in os.listdir(f"/proc/{agent}/task"):
            with open(f"/proc/{agent}/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as cmd:
                        if b"overlap" in cmd.read():
                            return int(child)
        return None

    def partials(self) -> list[str]:
        if not os.path.isdir(self.checkpoints):
            return []
        return [name for name in os.listdir(self.checkpoints) if name.endswith(".partial")]

    def complete(self) -> list[str]:
        if not os.path.isdir(self.checkpoints):
            return []
        return [name for name in os.listdir(self.checkpoints) if name.startswith("step-") and "." not in name]

    def running(self) -> bool:
        return all(agent.poll() is None for agent in self.agents)

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def _wait(condition, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(POLL_S)
    return False


def _kill(job: Job, kill: Kill, rounds: int, deadline: float) -> bool:
    """Wait for the kill point in the current round, kill; False if it never came."""
    def round_stepped() -> bool:
        started, step = job.round_state()
        return started == rounds and step >= 1 and job.worker(kill.node) is not None

    if not _wait(round_stepped, deadline):
        return False
    if kill.point == "start":
        if job.complete():
            return False                       # the job outran the schedule
    elif kill.point in ("step", "node"):
        first = job.round_state()[1]
        if not _wait(lambda: job.complete() and job.round_state()[1] >= first + 1, deadline):
            return False
        time.sleep(random.uniform(0, 0.05))
    elif kill.point == "save":
        if not _wait(lambda: bool(job.partials()), deadline):
            return False
    pid = job.worker(kill.node)
    if kill.point == "node":
        os.killpg(job.agents[kill.node].pid, signal.SIGKILL)
    elif pid is not None:
        os.kill(pid, signal.SIGKILL)
    if kill.point == "save":
        kill.during_save = bool(job.partials())
    kill.at_step = job.round_state()[1]
    return True


def run_schedule(workdir: str, argv: Sequence[str], points: Sequence[str], nnodes: str = "2",
                 python: str = sys.executable, timeout_s: float = 300, env: Optional[dict] = None) -> Outcome:
    """One elastic torchrun job on the two nodes, killed at `points` in turn (see the module's
    docstring); returns each kill with its recovery time and the job's final line."""
    kills = [Kill(point, node=1 if point == "node" else index % NODES) for index, point in enumerate(points)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", **(env or {})}
    deadline = time.monotonic() + timeout_s
    with two_node_cluster(None) as cluster:
        job = Job(cluster, workdir, argv, nnodes, max_restarts=len(points) + 1, python=python, env=environment)
        try:
            for rounds, kill in enumerate(kills, start=1):
                if not _kill(job, kill, rounds, deadline):
                    break
                killed_at = time.monotonic()
                if _wait(lambda: job.round_state()[0] > rounds and job.round_state()[1] > 0
                         and job.round_state()[1] >= _resumed_step(job), deadline):
                    kill.recovered_s = time.monotonic() - killed_at
                else:
                    break
            for node, agent in enumerate(job.agents):
                if node == 1 and any(kill.point == "node" for kill in kills):
                    continue
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            job.stop()
        logs = [job.log(node) for node in range(NODES)]
    found = FINAL.findall(logs[0])
    final = (int(found[-1][0]), float(found[-1][1]), float(found[-1][2])) if found else None
    return Outcome(kills, [agent.returncode for agent in job.agents], logs, final)


def _resumed_step(job: Job) -> int:
    """The step the current round resumed at, plus one: its first step done."""
    text = job.log(0).rsplit("overlap train: GPT ", 1)[-1]
    resumed = RESUMED.findall(text)
    return (int(resumed[-1]) if resumed else 0) + 1


def reference_final(workdir: str, argv: Sequence[str], python: str = sys.executable) -> tuple[int, float, float]:
    """The uninterrupted job's final line (2 ranks on this machine, self-launched)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC_")}
    done = subprocess.run([python, "-m", "overlap", "train", *argv, "--checkpoint-dir", "ckpt"], cwd=workdir, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=600, check=True)
    step, loss, val = FINAL.findall(done.stdout)[-1]
    return int(step), float(loss), float(val)


def table(outcome: Outcome, reference: tuple[int, float, float], tolerance: float) -> str:
    """Kill point x runs x exact / within tolerance / failed, and the recovery times."""
    rows = ["kill point | kills | recovered | exact end | within tolerance | failed | kill -> first step (s)",
            "---|---|---|---|---|---|---"]
    ended = outcome.final is not None
    exact = ended and outcome.final == reference
    close = ended and abs(outcome.final[1] - reference[1]) <= tolerance
    for point in dict.fromkeys(kill.point for kill in outcome.kills):
        mine = [kill for kill in outcome.kills if kill.point == point]
        recovered = [kill for kill in mine if kill.recovered_s is not None]
        times = ", ".join(f"{kill.recovered_s:.1f}" for kill in recovered)
        ok = len(recovered) == len(mine)
        rows.append(f"{point} | {len(mine)} | {len(recovered)} | {len(mine) if ok and exact else 0} | "
                    f"{len(mine) if ok and close and not exact else 0} | {len(mine) - len(recovered) if not ok else (0 if close else len(mine))} | {times}")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", default="start,step,save", help="kill points, comma-separated")
    parser.add_argument("--repeat", type=int, default=5, help="kills of each point (default 5)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--nnodes", default="2", help="torchrun --nnodes, e.g. 1:2 (default 2)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (and overlap) to run")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="recovery-")
    job = [*JOB, "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every)]
    points = [point for point in args.kills.split(",") for _ in range(args.repeat)]
    os.makedirs(os.path.join(workdir, "reference"), exist_ok=True)
    reference = reference_final(os.path.join(workdir, "reference"), job, args.python)
    outcome = run_schedule(workdir, job, points, args.nnodes, args.python, args.timeout)
    print(f"reference final {reference}; killed job final {outcome.final}; exit codes {outcome.returncodes}")
    for kill in outcome.kills:
        print(kill)
    print(table(outcome, reference, tolerance=1e-4))
    return 0 if outcome.final is not None else 1


if __name__ == "__main__":
    sys.exit(main())
