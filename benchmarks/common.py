"""The harness the benchmark scripts share (they run as `python benchmarks/<name>.py`, so
this directory is on `sys.path`): options, launches under a deadline, rank helpers, paired
per-round statistics, run records, tables and result files."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from netns import throttled_namespace

LOOPBACK = "loopback"
_RATE = re.compile(r"^\d+(\.\d+)?[kmg]bit$")
# Gloo's default is 30 minutes; a rank stuck that long would outlive every deadline below.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def parse_links(text: str) -> list[str]:
    """'loopback,10gbit,2gbit' -> ['loopback', '10gbit', '2gbit'], each validated."""
    links = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not links:
        raise ValueError(f"--links {text!r} names no link")
    for link in links:
        if link != LOOPBACK and not _RATE.match(link):
            raise ValueError(f"--links: {link!r} is neither 'loopback' nor a tc rate such as '2gbit' or '400mbit'")
    return links


def parse_choices(text: str, choices: Sequence[str], option: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `choices`."""
    picked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in picked if name not in choices]
    if unknown or not picked:
        raise ValueError(f"{option} {text!r}: unknown {unknown}; choose from {', '.join(choices)}")
    return picked


def parse_sizes(text: str, option: str) -> list[float]:
    """'1,8,32' -> [1.0, 8.0, 32.0]; every value must be a number > 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{option} {text!r}: every value must be a number > 0")
    return values


@contextlib.contextmanager
def on_link(link: str) -> Iterator[list[str]]:
    """The command prefix for `link`: none for loopback, a throttled namespace for a rate."""
    if link == LOOPBACK:
        yield []
    else:
        with throttled_namespace(link) as prefix:
            yield prefix


def torchrun(script: str, nproc: int, args: Sequence[str], python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            script, *args]


def checkout_python(checkout: str) -> str:
    """The interpreter of another checkout (`make setup` there builds its .venv)."""
    return os.path.join(checkout, ".venv", "bin", "python")


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(checkout: str = REPOSITORY) -> str:
    """The commit `checkout` is at, '+changes' when tracked files differ; "unknown" without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class RunRecord:
    """A result file's record of its run: commit, command (`hidden` arguments by a placeholder:
    no path of this machine), start, torch build, and the shared host's load before and after."""

    def __init__(self, script: str, argv: Sequence[str], hidden: Optional[dict[str, str]] = None) -> None:
        import torch

        shown = [(hidden or {}).get(arg, arg) for arg in argv]
        self.command = shlex.join(["python", f"benchmarks/{script}", *shown])     # runnable as written
        self.commit = git_commit()
        self.started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self.torch = torch.__version__
        self.loadavg_before = list(os.getloadavg())
        self._wall_start = time.perf_counter()

    def fields(self) -> dict[str, Any]:
        return dict(commit=self.commit, command=self.command, time=self.started, torch=self.torch,
                    cpus=os.cpu_count(), loadavg_before=self.loadavg_before, loadavg_after=list(os.getloadavg()))

    def host_load(self, **extra: Any) -> dict[str, Any]:
        return dict(load_1_5_15min_before=self.loadavg_before, load_1_5_15min_after=list(os.getloadavg()),
                    wall_s=time.perf_counter() - self._wall_start, **extra)

    def host(self, **extra: Any) -> dict[str, Any]:
        return dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=self.torch, **extra,
                    load_before=self.loadavg_before, load_after=list(os.getloadavg()))


def launch(script: str, nproc: Optional[int], worker_args: Sequence[str], timeout_s: float, prefix: Sequence[str] = (),
           python: str = sys.executable, env: Optional[dict] = None) -> Any:
    """Run `script` on `nproc` single-threaded local ranks (None: one process, no torchrun)
    behind `prefix` within `timeout_s`; what rank 0 wrote to the `--result FILE` it is given."""
    with tempfile.TemporaryDirectory() as scratch:
        result = os.path.join(scratch, "result.json")
        worker = [*worker_args, "--result", result]
        command = [python, script, *worker] if nproc is None else torchrun(script, nproc, worker, python)
        run_with_deadline([*prefix, *command], timeout_s, env={**single_thread_env(), **(env or {})})
        return read_json(result)


def launch_worker(script: str, nproc: int, args: argparse.Namespace, options: Sequence[str], *extra: str,
                  prefix: Sequence[str] = (), env: Optional[dict] = None) -> Any:
    """`launch` of `script --worker`, `extra` and the `options` of `args` within args.timeout."""
    return launch(os.path.abspath(script), nproc, ["--worker", *extra, *forwarded(args, options)], args.timeout, prefix,
                  env=env)


def forwarded(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The options `names` of `args` as a command line again (a bare flag for True, none for None or False)."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None and value is not False:
            out += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def run_with_deadline(command: Sequence[str], timeout_s: float, env: Optional[dict] = None) -> str:
    """Run `command` in its own process group and return its output; on a timeout or an
    interrupt the whole group is killed; a failure raises with the output's tail."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(command)} did not finish within {timeout_s:.0f} s; "
                           f"last output:\n{output[-3000:]}") from None
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}; last output:\n{output[-3000:]}")
    return output


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's group and its children (torchrun starts each rank in its own session)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)
    proc.wait()


def script_main(argv: Optional[Sequence[str]], parse_args: Callable[[Sequence[str]], Any],
                run_worker: Callable[[Any], None], run_driver: Callable[[Any], int]) -> int:
    """Entry of a script that is the driver and, with --worker, each launched rank's program."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        run_worker(args)
        # End at once, the process group not destroyed: at teardown gloo's threads may wait for the
        # GIL while the main thread joins them from the group's destructor (a hang after the work).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # SIGTERM becomes SystemExit: launched ranks are killed and namespaces deleted on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run_driver(args)


def arg_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_options(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """`--<name>` for each keyword, of its default's type (str for None): options needing no help."""
    for name, default in defaults.items():
        kind = str if default is None else type(default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)


def require_min(parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(args, name)}")


def parse_recorded(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser`'s arguments, with the command line kept as `argv` for the result file's record."""
    args = parser.parse_args(argv)
    args.argv = list(argv)
    return args


def parse_with_worker_options(parser: argparse.ArgumentParser, argv: Sequence[str],
                              workers: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """`parse_recorded` with a launched rank's hidden --result and --worker (a flag, or one of `workers`)."""
    kind: dict[str, Any] = dict(action="store_true") if workers is None else dict(choices=workers)
    parser.add_argument("--worker", help=argparse.SUPPRESS, **kind)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parse_recorded(parser, argv)


def proc_status_kib(field: str) -> int:
    """A memory figure of this process in KiB from /proc/self/status (VmRSS, VmHWM, RssAnon...)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss() -> int:
    """The largest resident memory of this process so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """The peak (bytes) of each /proc/self/status field while the block runs, sampled every
    `interval_s` on a thread; `growth(field)` is the peak over the value on entry."""

    def __init__(self, fields: Sequence[str], interval_s: float) -> None:
        self.fields, self.interval_s = tuple(fields), interval_s

    def _read(self) -> dict[str, int]:
        return {field: 1024 * proc_status_kib(field) for field in self.fields}

    def __enter__(self) -> "PeakMemory":
        self.start = self._read()
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = {field: max(self.peak[field], now) for field, now in self._read().items()}

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self, field: str) -> int:
        return self.peak[field] - self.start[field]


def single_thread_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def single_rank_env() -> dict[str, str]:
    """The environment torchrun gives the one rank of a world of one, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1")


def start_rank() -> tuple[int, int]:
    """A launched rank's start: one compute thread and the gloo process group; (rank, world size)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def from_every_rank(mine: Any) -> list[Any]:
    """Every rank's `mine` (any picklable value), in rank order, on every rank."""
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def to_driver(result: str, mine: Any, **extra: Any) -> None:
    """Every rank's `mine` as "ranks", with `extra`, in the driver's result file (rank 0 writes)."""
    import torch.distributed as dist

    ranks = from_every_rank(mine)
    if dist.get_rank() == 0:
        write_json(result, dict(ranks=ranks, **extra))


def train_step(model: Any, optimizer: Any, *batch: Any) -> Callable[[], None]:
    """One training step of `model(*batch)` (a loss) with `optimizer`."""
    def step() -> None:
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def seconds_of(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def device_seconds(call: Callable[[], object], device: Any) -> float:
    """Seconds of one `call()`: by CUDA events on the current stream on a GPU, else by the host's clock."""
    if device.type != "cuda":
        return seconds_of(call)
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def timed_steps(step: Callable[[], object], count: int) -> list[float]:
    """The seconds of each of `count` calls of `step`, each after a barrier."""
    import torch.distributed as dist

    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def slower_rank(per_rank: Iterable[Sequence[float]]) -> list[float]:
    """Each step's time as the slower rank's, from one list of times per rank."""
    return [max(times) for times in zip(*per_rank)]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Per-round values (paired ratios, shares) as result files record them."""
    return dict(per_round=list(values), median=median(values), min=min(values), max=max(values))


def ratio_fields(ratios: Sequence[float], digits: int, median_key: str = "ratio_median") -> dict[str, float]:
    """Paired per-round ratios as a summary's median, "ratio_min" and "ratio_max", rounded."""
    return {median_key: round(median(ratios), digits), "ratio_min": round(min(ratios), digits),
            "ratio_max": round(max(ratios), digits)}


def ratio_cell(summary: dict[str, Any], median_key: str = "ratio_median") -> str:
    return f"{summary[median_key]} ({summary['ratio_min']}–{summary['ratio_max']})"


def spread_cell(values: Optional[Any], digits: int = 2, scale: float = 1.0) -> str:
    """'median (min–max)' of a spread (see `spread`) or of a list of values; '–' for none."""
    if not values:
        return "–"
    stats = values if isinstance(values, dict) else spread(values)
    low, middle, high = (f"{stats[key] * scale:.{digits}f}" for key in ("min", "median", "max"))
    return f"{middle} ({low}–{high})"


def spread_table(summary: dict[str, dict]) -> str:
    """A markdown table of named spreads (see `spread`): median and range of each."""
    rows = [[name, f"{s['median']:.3f}", f"{s['min']:.3f}–{s['max']:.3f}"] for name, s in summary.items()]
    return markdown_table(["figure", "median", "range"], rows)


def paired_ratios(per_round: Sequence[dict[str, Sequence[float]]], pairs: Sequence[tuple[str, str]],
                  label: str = "{row} / {peer}") -> dict[str, dict]:
    """For each (row, peer) of `pairs` that ran: the spread of the ratio of their median steps in
    each round of `per_round` (row -> step times): runs of one round share the host's load."""
    out = {}
    for row, peer in pairs:
        ratios = [median(r[row]) / median(r[peer]) for r in per_round if r.get(row) and r.get(peer)]
        if ratios:
            out[label.format(row=row, peer=peer)] = spread(ratios)
    return out


def slowest_of_ranks(times: Sequence[float]) -> list[float]:
    """Each of `times` as the largest any rank measured at that position (a collective)."""
    import torch
    import torch.distributed as dist

    largest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.tolist()


def rotated(variants: Sequence[str], round_index: int) -> list[str]:
    """Round `round_index`'s order of the variants: the first rotates."""
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


def in_turns(variants: Sequence[str], rounds: int, measure: Callable[[str], Any]) -> dict[str, list]:
    """Variant -> `measure(variant)` in each of `rounds` rounds, the variants taking turns."""
    measured: dict[str, list] = {variant: [] for variant in variants}
    for round_index in range(rounds):
        for variant in rotated(variants, round_index):
            measured[variant].append(measure(variant))
    return measured


@contextlib.contextmanager
def patched(*replacements: tuple[Any, str, Any]) -> Iterator[None]:
    """Each (owner, name, value): `owner.name` is `value` inside the block."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile; the value itself for one value."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def print_and_write(text: str, path: Optional[str], data: Any) -> None:
    """Print `text`; write `data` to `path` as JSON where one is given."""
    print(text)
    if path:
        write_json(path, data)


def write_results(out_dir: str, name: str, data: Any, table: str) -> None:
    """<out_dir>/<name>.json with `data` and <out_dir>/<name>.md with `table`, which is printed."""
    write_json(os.path.join(out_dir, f"{name}.json"), data)
    write_text(os.path.join(out_dir, f"{name}.md"), table + "\n")
    print(table)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)
