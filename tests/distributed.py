"""Run a function on N gloo ranks in fresh processes, with a deadline, and collect results.

[Note: ranks forked from a preloaded server]
Each rank is a fresh process, but not a fresh interpreter: ranks are forked from one
multiprocessing fork server per test session that has already imported torch, the package
and the model code the tests wrap (HF GPT-2 and Llama). A spawned interpreter per rank
imported all of that again: 2 s for torch and 3 s more for the HF models on an idle 2-core
machine, 10-15 s under load, at every launch: more than most tests' own work.
The server imports modules only (no threads, no process group, no tensors on a device), so
forking from it is safe. A forked rank inherits the server's environment, not the test's:
the test's environment at launch is sent along and installed first, as a spawned rank would
have inherited it.

[Note: many cases on one launch]
Creating a process group and forking its ranks costs seconds on two loaded cores; a file that
launches once per case pays it per case. `CaseLaunch` runs a file's cases in turn on one set
of ranks, each case's outcome (its result, or the error it raised) recorded per rank, so a
test per case still fails by its own name. The launch runs when the first test asks for a
case; its failure (a timeout names the case each rank was in) is kept and reported by every
test that reads it, instead of launching again. Each case starts with the environment as
it was before the one ahead of it, and after a barrier; a case that leaves collectives
unmatched (ranks that diverge, a rank that is killed) gets a launch of its own.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240
# Imported once by the fork server (see the note above); one that is not installed is skipped
# (an ImportError); any other error in these imports stops the server and fails every launch.
# torch._dynamo: ShardedModule marks its hooks with it (overlap/runtime/compiled.py), 1-3 s to import.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "overlap", "overlap.sharded_module", "overlap.models",
           "pytest", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_store(world_size: int, backend: str | None) -> tuple[Any, int]:
    """The launch's rendezvous: a store the parent hosts on a port it bound itself, which the
    ranks join (no port picked free and bound later, which another launch could take
    meanwhile); None and a free port for `init_process_group()` from the environment, whose
    rank 0 hosts the store."""
    if backend is None:
        return None, _free_port()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    return store, store.port


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, env: dict, args: tuple,
           backend: str | None = "gloo") -> None:
    """One rank: joins the launch's store (from the environment when `backend` is None), runs
    `fn`, writes its result or error, and leaves."""
    os.environ.clear()          # the server's environment, replaced by the test's at launch
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any
    try:
        timeout = datetime.timedelta(seconds=60)
        if backend is None:       # `init_process_group()` as the README writes it (the machine's default)
            dist.init_process_group(rank=rank, world_size=world_size, timeout=timeout)
        else:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # gloo's worker threads and the process group's destructor can deadlock or abort during
    # interpreter shutdown (seen with plain DDP too); the result is written, so leave now.
    os._exit(0)


class RankError(RuntimeError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))


def run_distributed(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S, backend: str | None = "gloo") -> list[Any]:
    """`fn(rank, world_size, *args)` on every rank; returns the per-rank results.

    Raises RankError with every failing rank's traceback; a rank still running after
    `timeout` seconds is killed and reported.
    """
    store, port = _launch_store(world_size, backend)     # hosted until the ranks are done
    mp.set_forkserver_preload(PRELOAD)       # read once, when the first launch starts the server
    environment = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, port, out_dir, environment, args, backend),
                                 nprocs=world_size, join=False, start_method="forkserver")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while not ctx.join(timeout=1):
            if datetime.datetime.now() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
        results, errors = [], {}
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors[rank] = value
            results.append(value)
        if errors:
            raise RankError(errors)
        return results


@dataclass(frozen=True)
class RankCase:
    """`fn(rank, world_size, *args)` run by every rank with `env` set for this case only."""
    fn: Callable
    args: tuple = ()
    env: dict = field(default_factory=dict)


class Outcome(NamedTuple):
    """One case on one rank: its result, or "ErrorType: message" and the traceback."""
    ok: bool
    value: Any
    trace: str = ""

    def result(self) -> Any:
        assert self.ok, f"the case raised {self.value}\n{self.trace}"
        return self.value

    def error(self) -> str:
        assert not self.ok, f"the case did not raise; it returned {self.value!r}"
        return self.value


def _run_cases_on_rank(rank: int, world_size: int, cases: dict[str, RankCase], progress_dir: str) -> dict:
    import torch.distributed as dist

    outcomes = {}
    for name, case in cases.items():
        with open(os.path.join(progress_dir, f"rank{rank}"), "w") as f:
            f.write(name)
        saved_env = dict(os.environ)
        os.environ.update(case.env)
        try:
            outcomes[name] = Outcome(True, case.fn(rank, world_size, *case.args))
        except Exception as exc:  # noqa: BLE001 - the case's outcome, checked by its test
            outcomes[name] = Outcome(False, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        finally:
            os.environ.clear()      # also undoes what the case set itself
            os.environ.update(saved_env)
        dist.barrier()              # every rank starts the next case together
    return outcomes


def _read_progress(progress_dir: str, rank: int) -> str:
    path = os.path.join(progress_dir, f"rank{rank}")
    if not os.path.exists(path):
        return "none yet"
    with open(path) as f:
        return f.read()


class CaseLaunch:
    """Named cases run in turn on one launch of `world_size` ranks, launched on first use,
    after the launches in `after` (whose files its cases read); `launch[name]` is that case's
    outcome on each rank. See [Note: many cases on one launch]."""

    def __init__(self, cases: dict[str, RankCase], world_size: int, env: Optional[dict] = None,
                 timeout: float = DEFAULT_TIMEOUT_S, after: Sequence["CaseLaunch"] = ()) -> None:
        self.cases, self.world_size, self.env, self.timeout, self.after = cases, world_size, env, timeout, after
        self._outcomes: Optional[list[dict]] = None
        self._failure: Optional[BaseException] = None

    def run_once(self) -> None:
        """Run the launch unless it has run (its failure is kept, not raised here)."""
        if self._outcomes is None and self._failure is None:
            for earlier in self.after:
                earlier.run_once()
            self._launch()

    def failure(self) -> Optional[BaseException]:
        """What stopped the launch (None when every rank returned), once it has run."""
        self.run_once()
        return self._failure

    def __getitem__(self, name: str) -> list[Outcome]:
        self.run_once()
        if self._failure is not None:
            raise RuntimeError(f"the launch running case {name!r} failed: {self._failure}") from self._failure
        return [per_rank[name] for per_rank in self._outcomes]

    def _launch(self) -> None:
        with tempfile.TemporaryDirectory() as progress_dir:
            try:
                self._outcomes = run_distributed(_run_cases_on_rank, self.world_size, self.cases, progress_dir,
                                                 env=self.env, timeout=self.timeout)
            except TimeoutError as exc:
                running = {rank: _read_progress(progress_dir, rank) for rank in range(self.world_size)}
                self._failure = TimeoutError(f"{exc}; the case each rank was running: {running}")
            except Exception as exc:  # noqa: BLE001 - kept and reported by every test that reads it
                self._failure = exc
