"""Kill `overlap train`'s workers on the emulated two-node cluster (cluster.py) at chosen points
of torchrun jobs, and measure how they recover: whether every restart met again, the time from
the kill to the first step after the resume, and whether each job ended on the uninterrupted
run's final loss (docs/train.md). Needs root.

    python benchmarks/recovery.py --kills start,step,save --runs 5
    python benchmarks/recovery.py --kills node --runs 5 --nnodes 1:2
    python benchmarks/recovery.py --kills node,rejoin --runs 2 --nnodes 1:2

Kill points: `start` a worker before any checkpoint of its round is complete; `step` a worker
at a random moment after one is; `save` a worker while an asynchronous save is written (both
paused while that is checked); `node` node 1's agent and worker for good (an elastic job goes
on alone); `rejoin` node 1's agent started again once node 0 alone has saved. Worker kills
alternate between the nodes; each node runs on its half of the CPUs.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from cluster import NODES, Cluster, node_cpus, two_node_cluster
from common import RunRecord, arg_parser, markdown_table, print_and_write

JOB = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2",
       "--eval-every", "7", "--bucket-mb", "1", "--prefetch-depth", "1"]
RUN_JOB = [*JOB, "--steps", "30", "--checkpoint-every", "5"]     # what main() runs
RUN_TIMEOUT_S = 600
# A round closes a second after enough nodes joined; a node is dead after 5 s without a
# keep-alive (2 s made loaded machines declare live nodes dead, which then started jobs of their own).
RDZV_CONF = ["last_call_timeout=1", "close_timeout=5", "keep_alive_interval=1", "keep_alive_max_attempt=5"]
# torch 2.13's c10d rendezvous sharing its TCP store never tells a node joining a later round
# the workers' store address (both agents exit after 60 s): elastic jobs opt out of the sharing.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
HEADER = "overlap train: GPT "
WORLD = re.compile(r" on (\d+) CPU ranks ")
BAR = re.compile(r"train:\s+\d+%\|[^|]*\|\s*(\d+)/\d+ ")
RESUMED = re.compile(r"^resumed from \S+ at step (\d+)$", re.M)
FINAL = re.compile(r"^final step (\d+): loss ([\d.]+) .*, val loss ([\d.]+)$", re.M)
DETECTED = re.compile(r"Detected \d+ new nodes")
POINTS = ("start", "step", "save", "node", "rejoin")
POLL_S = 0.01


@dataclass
class Round:
    """One start of the job's workers, as rank 0 printed it."""
    world: int
    resumed: int                   # the step it resumed at (0: from scratch)
    step: int                      # completed steps on its progress bar


@dataclass
class Kill:
    point: str                     # one of POINTS
    node: int
    fired: bool = False            # the kill point came and the kill was made
    round: int = 0                 # rounds started when it fired
    at_step: int = -1              # the killed round's completed steps
    newest: Optional[int] = None   # the newest complete checkpoint's step when it fired
    saving: Optional[int] = None   # save kills: the step of the save being written
    during_save: Optional[bool] = None  # save kills: that save was still incomplete when killed
    resumed_at: Optional[int] = None    # the step the next round resumed at
    recovered_s: Optional[float] = None  # kill (rejoin: the agent's start) -> first step of the next round
    fired_at: float = 0.0          # time.monotonic() of the kill


@dataclass
class Outcome:
    kills: list[Kill]
    returncodes: list[Optional[int]]
    logs: list[str]
    final: Optional[tuple[int, float, float]] = None
    rounds: list[Round] = field(default_factory=list)
    seconds: float = 0.0


class Job:
    """One torchrun job across the two nodes, its logs in files, and its workers."""

    def __init__(self, cluster: Cluster, workdir: str, argv: Sequence[str], nnodes: str, max_restarts: int,
                 env: dict) -> None:
        self.cluster, self.argv, self.nnodes, self.max_restarts = cluster, list(argv), nnodes, max_restarts
        self.env, self.workdir = env, workdir
        self.run_id = uuid.uuid4().hex
        self.checkpoints = os.path.join(workdir, "ckpt")
        self.log_paths = [os.path.join(workdir, f"node{node}.log") for node in range(NODES)]
        self.agents: list[Optional[subprocess.Popen]] = [None] * NODES
        self._cache: tuple[int, list[Round]] = (-1, [])
        # Node 1 first: both are there when node 0 opens the first round.
        for node in reversed(range(NODES)):
            self.start_agent(node)

    def start_agent(self, node: int) -> None:
        command = self.cluster.torchrun(node, 1, ["-m", "overlap", "train", *self.argv, "--checkpoint-dir",
                                                  self.checkpoints], run_id=self.run_id,
                                        nnodes=self.nnodes, max_restarts=self.max_restarts, rdzv_conf=RDZV_CONF,
                                        cpus=node_cpus(node))
        with open(self.log_paths[node], "a") as sink:
            self.agents[node] = subprocess.Popen(command, cwd=self.workdir, env=self.env, stdout=sink,
                                                 stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, node: int) -> str:
        with open(self.log_paths[node], errors="replace") as f:
            return f.read()

    def rounds(self) -> list[Round]:
        """Every round so far, from rank 0's output (read again only when it grew)."""
        size = os.path.getsize(self.log_paths[0])
        if size != self._cache[0]:
            rounds = []
            for text in self.log(0).split(HEADER)[1:]:
                world = WORLD.search(text.split("\n", 1)[0])
                resumed = RESUMED.findall(text)
                start = int(resumed[0]) if resumed else 0
                steps = [int(s) for s in BAR.findall(text)]
                rounds.append(Round(int(world.group(1)) if world else 0, start, max([start, *steps])))
            self._cache = (size, rounds)
        return self._cache[1]

    def worker(self, node: int) -> Optional[int]:
        """The pid of the node's worker (a child of its agent), or None."""
        agent = self.agents[node]
        if agent is None or agent.poll() is not None:
            return None
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in os.listdir(f"/proc/{agent.pid}/task"):
                with open(f"/proc/{agent.pid}/task/{task}/children") as f:
                    for child in f.read().split():
                        with open(f"/proc/{child}/cmdline", "rb") as cmd:
                            if b"overlap" in cmd.read():
                                return int(child)
        return None

    def saved(self) -> list[str]:
        return os.listdir(self.checkpoints) if os.path.isdir(self.checkpoints) else []

    def complete(self) -> list[int]:
        """The steps of the complete checkpoints."""
        return [int(name[5:]) for name in self.saved() if name.startswith("step-") and "." not in name]

    def kill_node(self, node: int) -> None:
        """The node is gone: its agent and its worker (in a session of its own) at once."""
        worker = self.worker(node)
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        if worker is not None:
            _signal(worker, signal.SIGKILL)
        self.agents[node].wait()

    def stop(self) -> None:
        for node, agent in enumerate(self.agents):
            if agent is not None and agent.poll() is None:
                self.kill_node(node)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait(condition, deadline: float, alive=lambda: True) -> bool:
    """Poll `condition` until it holds (True), the deadline passes or `alive()` fails (False)."""
    while time.monotonic() < deadline:
        if condition():
            return True
        if not alive():
            return False
        time.sleep(POLL_S)
    return False


def _fire(job: Job, kill: Kill, after: int, deadline: float) -> bool:
    """Wait for the kill point in a round after the first `after`, and kill; False if it never came."""
    world = 1 if kill.point == "rejoin" else NODES
    watched = 0 if kill.point == "rejoin" else kill.node
    # A round later than the first `after` runs at `world` with a worker on the watched node.
    if not _wait(lambda: len(job.rounds()) > after and job.rounds()[-1].world == world
                 and job.worker(watched) is not None, deadline):
        return False
    index = len(job.rounds())
    this_round = lambda: job.rounds()[index - 1]          # noqa: E731
    began = time.time()
    alive = lambda: job.worker(watched) is not None      # noqa: E731
    if kill.point == "start":
        if job.complete():
            return False                       # only a job that has no checkpoint yet
    elif kill.point in ("step", "node"):
        if not _wait(lambda: any(s > this_round().resumed for s in job.complete())
                     and this_round().step > max(job.complete()), deadline, alive):
            return False
        time.sleep(random.uniform(0, 0.05))
    elif kill.point == "save":
        def fresh() -> list[str]:              # written by this round (a killed save's stays behind)
            found = []
            for name in (name for name in job.saved() if name.endswith(".partial")):
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(os.path.join(job.checkpoints, name)).st_mtime >= began:
                        found.append(name)
            return found

        while True:
            if not _wait(lambda: bool(fresh()), deadline, alive):
                return False
            frozen = [pid for pid in (job.worker(node) for node in range(NODES)) if pid is not None]
            for pid in frozen:                 # nobody finishes the save while it is checked
                _signal(pid, signal.SIGSTOP)
            writing = fresh()
            if writing and job.worker(kill.node) in frozen:
                break
            for pid in frozen:                 # it completed in between: wait for the next one
                _signal(pid, signal.SIGCONT)
    elif kill.point == "rejoin":
        if not _wait(lambda: any(s > this_round().resumed for s in job.complete()), deadline, alive):
            return False
        pid = job.worker(0)
        if pid is None:
            return False
        _signal(pid, signal.SIGSTOP)
        kill.round, kill.at_step, kill.fired, kill.fired_at = index, this_round().step, True, time.monotonic()
        kill.newest = max(job.complete())
        seen = len(DETECTED.findall(job.log(0)))
        job.start_agent(1)
        held = _wait(lambda: len(DETECTED.findall(job.log(0))) > seen, deadline)
        _signal(pid, signal.SIGCONT)           # its agent stops it now (SIGTERM)
        return held
    pid = job.worker(kill.node)
    if pid is None:
        return False
    if kill.point == "node":
        job.kill_node(kill.node)
    else:
        _signal(pid, signal.SIGKILL)
    kill.round, kill.at_step, kill.fired, kill.fired_at = index, this_round().step, True, time.monotonic()
    kill.newest = max(job.complete(), default=None)
    if kill.point == "save":
        kill.saving = int(writing[0][5:-len(".partial")])
        partial = os.path.join(job.checkpoints, writing[0])
        kill.during_save = os.path.isdir(partial) and not os.path.isdir(partial[:-len(".partial")])
        for other in frozen:
            if other != pid:
                _signal(other, signal.SIGCONT)
    return True


def run_schedule(workdir: str, argv: Sequence[str], points: Sequence[str], nnodes: str = "2",
                 timeout_s: float = 300, env: Optional[dict] = None) -> Outcome:
    """One torchrun job on the two nodes, killed at `points` in turn: each kill with its recovery."""
    unknown = [point for point in points if point not in POINTS]
    if unknown:
        raise ValueError(f"unknown kill points {unknown}; known: {', '.join(POINTS)}")
    workers = itertools.count()              # worker kills alternate between the nodes
    kills = [Kill(point, node=1 if point in ("node", "rejoin") else next(workers) % NODES) for point in points]
    elastic = ":" in nnodes
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", **(ELASTIC_ENV if elastic else {}),
                   **(env or {})}
    started = time.monotonic()
    deadline = started + timeout_s
    with two_node_cluster(None) as cluster:
        job = Job(cluster, workdir, argv, nnodes, max_restarts=len(points) + 1, env=environment)
        try:
            after = 0
            for kill in kills:
                if not _fire(job, kill, after, deadline):
                    break
                world = 1 if kill.point == "node" else NODES
                if not _wait(lambda: len(job.rounds()) > kill.round and job.rounds()[-1].world == world
                             and job.rounds()[-1].step > job.rounds()[-1].resumed, deadline):
                    break
                kill.recovered_s = time.monotonic() - kill.fired_at
                kill.resumed_at = job.rounds()[-1].resumed
                after = kill.round
            for agent in job.agents:
                if agent is not None and agent.returncode is None:
                    agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            job.stop()
        logs = [job.log(node) for node in range(NODES)]
        rounds = job.rounds()
    found = FINAL.findall(logs[0])
    final = (int(found[-1][0]), float(found[-1][1]), float(found[-1][2])) if found else None
    codes = [agent.returncode if agent is not None else None for agent in job.agents]
    return Outcome(kills, codes, logs, final, rounds, time.monotonic() - started)


def reference_final(workdir: str, argv: Sequence[str]) -> tuple[int, float, float]:
    """The uninterrupted job's final line (2 ranks on this machine, self-launched)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC_")}
    done = subprocess.run([sys.executable, "-m", "overlap", "train", *argv, "--checkpoint-dir", "ckpt"],
                          cwd=workdir, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"},
                          timeout=600, check=True)
    step, loss, val = FINAL.findall(done.stdout)[-1]
    return int(step), float(loss), float(val)


def ending(outcome: Outcome, reference: tuple[int, float, float], tolerance: float) -> str:
    """"exact" (the uninterrupted final line), "within tolerance" or "failed"."""
    if outcome.final is None or any(kill.recovered_s is None for kill in outcome.kills):
        return "failed"
    if outcome.final == reference:
        return "exact"
    if outcome.final[0] == reference[0] and all(abs(a - b) <= tolerance
                                                 for a, b in zip(outcome.final[1:], reference[1:])):
        return "within tolerance"
    return "failed"


def table(runs: list[Outcome], endings: list[str]) -> str:
    """Per kill point: runs, kills, recoveries, endings and the times to the first step after."""
    rows = []
    points = dict.fromkeys(kill.point for outcome in runs for kill in outcome.kills)
    for point in points:
        mine = [(outcome, end) for outcome, end in zip(runs, endings) if any(k.point == point for k in outcome.kills)]
        kills = [kill for outcome, _ in mine for kill in outcome.kills if kill.point == point]
        times = sorted(kill.recovered_s for kill in kills if kill.recovered_s is not None)
        spread = (f"{times[0]:.1f}-{times[-1]:.1f} (median {statistics.median(times):.1f})" if len(times) > 1
                  else (f"{times[0]:.1f}" if times else "-"))
        rows.append([point, len(mine), sum(k.fired for k in kills), sum(k.recovered_s is not None for k in kills),
                     *(sum(e == end for _, e in mine) for end in ("exact", "within tolerance", "failed")), spread])
    return markdown_table(["kill point", "runs", "kills fired", "recovered", "run ended exact", "within tolerance",
                           "failed", "kill to first step after resume (s)"], rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--kills", default="start,step,save", help="kill points of each run, comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="jobs, each killed at every point (default 5)")
    parser.add_argument("--nnodes", default="2", help="torchrun --nnodes, e.g. 1:2 (default 2)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="loss difference allowed to a run at another world size (default 1e-4)")
    parser.add_argument("--out", default=None, help="write the runs and the table as JSON here")
    args = parser.parse_args(argv)
    # A terminated benchmark still stops its jobs and deletes its namespaces (the `finally`s).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    run_record = RunRecord("recovery.py", argv if argv is not None else sys.argv[1:])
    workdir, job = tempfile.mkdtemp(prefix="recovery-"), RUN_JOB
    points = args.kills.split(",")
    os.makedirs(os.path.join(workdir, "reference"), exist_ok=True)
    reference = reference_final(os.path.join(workdir, "reference"), job)
    print(f"uninterrupted run: final {reference}", flush=True)
    runs, endings = [], []
    for index in range(args.runs):
        run_dir = os.path.join(workdir, f"run{index}")
        os.makedirs(run_dir)
        outcome = run_schedule(run_dir, job, points, args.nnodes, RUN_TIMEOUT_S)
        runs.append(outcome)
        endings.append(ending(outcome, reference, args.tolerance))
        print(f"run {index}: {outcome.seconds:.0f} s, final {outcome.final}, exit codes {outcome.returncodes}, "
              f"{endings[-1]}; rounds (world, resumed, steps) "
              f"{[(r.world, r.resumed, r.step) for r in outcome.rounds]}", flush=True)
        for kill in outcome.kills:
            print(f"  {kill}", flush=True)
    text = table(runs, endings)
    print_and_write(text, args.out, {
        **run_record.fields(), "job": job, "nnodes": args.nnodes, "rdzv_conf": RDZV_CONF,
        "env": ELASTIC_ENV if ":" in args.nnodes else {}, "node_cpus": [node_cpus(node) for node in range(NODES)],
        "machine": platform.machine(), "tolerance": args.tolerance, "reference_final": reference, "table": text,
        "runs": [{"seconds": round(o.seconds, 1), "final": o.final, "returncodes": o.returncodes, "ending": end,
                  "rounds": [asdict(r) for r in o.rounds],
                  "kills": [{**{key: value for key, value in asdict(k).items() if key != "fired_at"},
                             "recovered_s": None if k.recovered_s is None else round(k.recovered_s, 2)}
                            for k in o.kills]} for o, end in zip(runs, endings)]})
    return 0 if "failed" not in endings else 1


if __name__ == "__main__":
    sys.exit(main())
