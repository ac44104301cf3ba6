"""AdamW over state that lives on disk: the fp32 master and both moments of a rank's flat
shards, in one state file (`state_file.py`), stepped bucket by bucket through a fixed set of
host buffers while the next bucket is read and the previous one written back.

[Note: the disk pipeline]
Bucket k uses buffer k mod B (B = `buffers`, 3 by default: plan/offload.py DISK_BUFFERS).
One reader thread and one writer thread each run their calls in order:

    reader:   read k+1                      read k+2 ...
    main:               step k (kernel)                 step k+1 ...
    writer:   write k-1                     write k ...

The read of bucket k+1 goes into the buffer bucket k-2 was written from, so it is submitted
only once that write has finished. The reads and writes (os.preadv / os.pwritev) and the
fused kernel (torch.ops.overlap.adamw_step, entered through the dispatcher without the GIL)
all run outside the interpreter lock, so the three overlap, and a step costs about
max(IO, update) rather than their sum (benchmarks/offload_disk.py measures both).

Host memory is the B buffers, allocated once, whatever the number of buckets; `peak_buffers`
counts the most that were ever held at once (from a read's submission to the end of its
write), and the tests check it against B.

An error in any of the three (a short file, a full disk) stops the step: the threads finish
their current call, then the error is raised naming the bucket. Buckets before it hold the new
step and those after it the old one, so the engine refuses every later step and says so,
instead of training on a state that is half one step and half the next.

A step may also be taken ahead, during backward, into each bucket's spare slot, and kept or
recomputed at `step()` (`speculate`; see [Note: the speculative step] in speculation.py).
Every step writes the spare slots and makes them current once all are written, so a step
that fails leaves the file at the state before it.

[Note: choosing between them]
A shard's state can instead be read ahead during backward into the engine's window and
written behind the step ([Note: reading ahead and writing behind] in window.py): its IO then
hides whatever the step does to the gradient, at the cost of holding the state in host
memory from backward to the write's end. A speculation costs no such memory and also hides
the update, but only while the gradient is the one backward left. So each shard speculates
until a step recomputes its speculation (a clip that binds, a scaled gradient), then reads
ahead, and goes back to speculating once a step finds its gradient as backward left it (the
speculation would have held). Under a clip that binds at every step, the first step
recomputes and every later one steps from the window; with no window (`window_bytes=0`, the
default of the engine alone) a shard always speculates.

[Note: saves streamed from the state file]
An asynchronous checkpoint save (overlap.checkpoint.async_save) writes the masters and
moments from memory maps of each bucket's current slot, read by DCP's writer thread while
training goes on, instead of a copy of the whole state in host memory. `pin()` keeps those
slots as they are until the save's files are written: the next step (taken ahead or not)
writes the spare slots and flips, untouched by the pin; the step after it would write the
pinned slots, and waits for the save to finish first (on the worker for a step taken ahead,
so backward does not wait). A load writes the current slots in place: the engine's own loads
wait for the pins, and the loads that write through maps (checkpoint, model and optimizer
state dicts) call `wait_pins()` first.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import torch

from .flat_step import adamw_step
from .speculation import Speculation, shard_segments
from .state_file import STATE_NAMES, Bucket, StateFile, aligned_buffer, bucket_views, plan_buckets
from .window import StateWindow

# Defaults of the bucket size and the buffer count: the planner's (overlap/plan/offload.py),
# repeated here because optim may not import plan; tests/test_offload_disk.py checks they agree.
DEFAULT_BUCKET_PARAMS = 2**24
DEFAULT_BUFFERS = 3


@dataclass(frozen=True)
class Hyper:
    """One parameter group's AdamW settings for this step; `step` is the step number after
    counting it (1 at the first step), as torch keeps it per parameter."""

    lr: float
    betas: Tuple[float, float]
    eps: float
    weight_decay: float
    step: float
    maximize: bool = False


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of flat shard `shard` are stepped with `hyper` (one parameter, or
    several consecutive ones of one group)."""

    shard: int
    start: int
    stop: int
    hyper: Hyper


class PagedAdamW:
    """AdamW for flat shards whose master weights and moments live in a state file.

    `shard_sizes`: elements of each flat shard of this rank; `param_starts`, where each
    shard's parameters begin, to cut buckets on their boundaries (`plan_buckets`); `window_bytes`,
    the host memory the buckets read ahead may hold ([Note: choosing between them]). The file is created under
    `directory` (a fresh temporary one when None) and removed by `close()` or at exit. A new
    file reads as zeros (reserved or sparse space), so masters and moments start at zero
    without writing it; `load_masters` sets the masters.
    """

    def __init__(self, shard_sizes: Sequence[int], *, directory: Optional[str] = None, rank: int = 0,
                 bucket_params: int = DEFAULT_BUCKET_PARAMS, buffers: int = DEFAULT_BUFFERS, direct: bool = True,
                 backend: str = "auto", param_starts: Optional[Sequence[Sequence[int]]] = None,
                 window_bytes: int = 0) -> None:
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 3:
            raise ValueError(f"buffers={buffers!r} is invalid; the pipeline needs at least 3 (read ahead, "
                             "stepping, writing back)")
        self.shard_sizes = tuple(shard_sizes)
        self.bucket_params = bucket_params
        self.buckets = plan_buckets(self.shard_sizes, bucket_params, param_starts)
        self.backend = backend
        self.file = StateFile(self.buckets, directory, rank=rank, direct=direct)
        largest = max((b.nbytes for b in self.buckets), default=0)
        # The host buffers the pipeline streams every bucket through (see [Note: the disk pipeline]).
        self._buffers = [aligned_buffer(largest) for _ in range(buffers)]
        self._held = 0
        self.peak_buffers = 0
        self._lock = threading.Lock()
        # One thread for reads and one for writes: each keeps its calls in bucket order, and the
        # two overlap each other and the kernel on the main thread.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="overlap-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="overlap-offload-write")
        self._broken: Optional[str] = None
        self.last_step = StepTimes(0.0, 0.0, 0.0)
        # Speculative steps (see [Note: the speculative step]) run on one worker thread, so that
        # engine calls never run concurrently: every call from another thread waits for it first.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="overlap-offload-speculate")
        self._speculations: dict[int, Speculation] = {}
        # Shards whose speculation a step committed, recomputed, or that were restored without a
        # step; seconds the worker spent in speculative steps. The tests and the benchmark read them.
        self.commits = self.recomputes = self.restores = 0
        self.speculated_s = 0.0
        # Shards a step took from the window instead (see [Note: choosing between them]).
        self.read_aheads = 0
        # Slots an asynchronous save is reading (see [Note: saves streamed from the state file]).
        self._pins: list[Pin] = []
        # Buckets read ahead during backward and written behind the step, up to `window_bytes`
        # of host memory (see [Note: reading ahead and writing behind] in window.py); the
        # shards that read ahead instead of speculating (see [Note: choosing between them]).
        self.window = StateWindow(self.file, self._reader, self._writer, window_bytes)
        self._reading_ahead: set[int] = set()

    def add_shard(self, size: int, param_starts: Optional[Sequence[int]] = None,
                  bucket_params: Optional[int] = None) -> int:
        """Add a shard of `size` elements at the end of the file (reading as zeros) and return
        its index; its buckets hold at most `bucket_params` elements (default: the engine's)."""
        self.wait_speculation()
        self._check_usable()
        buckets = plan_buckets([size], bucket_params or self.bucket_params,
                               None if param_starts is None else [param_starts], first_shard=len(self.shard_sizes),
                               offset=self.file.size)
        self.file.grow(buckets)
        self.buckets = list(self.buckets) + buckets
        self.shard_sizes += (size,)
        largest = max((b.nbytes for b in buckets), default=0)
        if largest > self._buffers[0].numel():
            self._buffers = [aligned_buffer(largest) for _ in self._buffers]
        return len(self.shard_sizes) - 1

    # -- buffer accounting --------------------------------------------------------------
    def _take(self) -> None:
        with self._lock:
            self._held += 1
            self.peak_buffers = max(self.peak_buffers, self._held)
            assert self._held <= len(self._buffers), "the disk pipeline held more buffers than it has"

    def _give(self) -> None:
        with self._lock:
            self._held -= 1

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the pipeline's buffers."""
        return sum(b.numel() for b in self._buffers)

    # -- the pipeline ----------------------------------------------------------------------
    def _run(self, indices: Sequence[int], work, *, read: bool = True, write: bool = True,
             spare: bool = False) -> None:
        """For each bucket index in order: read it (if `read`), call `work(index, bucket, buffer)`
        on the calling thread, write it back (if `write`; into its spare slot with `spare`); see
        [Note: the disk pipeline]. A failed write into spare slots leaves the state whole."""
        self._check_usable()
        if write:
            slots = [self.file.slot(self.buckets[k]) for k in indices]
            self._wait_for_pins([(k, 1 - slot if spare else slot) for k, slot in zip(indices, slots)])
        count = len(self._buffers)
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}

        def submit_read(j: int) -> None:
            if j - count in writes:
                writes.pop(j - count).result()       # its buffer must be written back first
            self._take()
            if read:
                reads[j] = self._reader.submit(self.file.read, self.buckets[indices[j]], self._buffers[j % count])
            else:
                done: Future = Future()
                done.set_result(None)
                reads[j] = done

        def write_back(bucket: Bucket, buffer: torch.Tensor) -> None:
            try:
                if write:
                    self.file.write(bucket, buffer, spare=spare)
            finally:
                self._give()

        try:
            if indices:
                submit_read(0)
            for j, index in enumerate(indices):
                if j + 1 < len(indices):
                    submit_read(j + 1)
                reads.pop(j).result()
                bucket, buffer = self.buckets[index], self._buffers[j % count]
                work(index, bucket, buffer)
                writes[j] = self._writer.submit(write_back, bucket, buffer)
            for j in sorted(writes):
                writes.pop(j).result()
        except BaseException as e:
            self._drain(reads, writes)
            if write and not spare:
                self._broken = f"{type(e).__name__}: {e}"
            raise

    def _drain(self, reads: dict[int, Future], writes: dict[int, Future]) -> None:
        """Wait for every call in flight (their buffers must not be reused under them)."""
        for future in list(reads.values()) + list(writes.values()):
            try:
                future.result()
            except BaseException:
                pass
        with self._lock:
            self._held = 0

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"rank {self.file.rank}: the offloaded optimizer state in {self.file.path!r} is "
                               f"inconsistent since a failed step or load ({self._broken}); some buckets hold the "
                               "new values and some the old. Load a checkpoint to go on.")
        self._check_open()

    def _check_open(self) -> None:
        if self.file.fd < 0:
            raise RuntimeError("the offloaded optimizer state was closed")

    def check_consistent(self) -> None:
        """Raise if a failed step or load left the file part old and part new (before reading
        the state out, as a checkpoint save does)."""
        self.wait_speculation()
        self._check_usable()

    def mark_inconsistent(self, reason: str) -> None:
        """Something that writes the file through its maps (a checkpoint load) failed midway:
        refuse steps and saves, as after a failed step, until `mark_consistent`."""
        self._broken = reason

    def mark_consistent(self) -> None:
        """Every element was written again from one state (a complete checkpoint load)."""
        self._broken = None

    # -- state ---------------------------------------------------------------------------
    def load_masters(self, masters: Union[Sequence[torch.Tensor], Callable[[int, int, int], torch.Tensor]]) -> None:
        """Set every shard's fp32 master and both moments to zero, a bucket at a time.

        `masters`: shard-sized tensors (any float dtype), or a function `(shard, start, stop)`
        returning those elements, so that no more than one bucket of masters need exist in
        memory at once (a model materialised piece by piece, a checkpoint read in slices)."""
        if callable(masters):
            values = masters
        else:
            self._check_sizes(masters, "masters")

            def values(shard: int, start: int, stop: int) -> torch.Tensor:
                return masters[shard].reshape(-1)[start:stop]
        self.abandon(restore=False)   # every master is written anew
        self._broken = None           # every bucket is written whole

        def fill(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
            master, exp_avg, exp_avg_sq = bucket_views(buffer, bucket.numel)
            value = values(bucket.shard, bucket.start, bucket.stop)
            if value.numel() != bucket.numel:
                raise ValueError(f"masters({bucket.shard}, {bucket.start}, {bucket.stop}) returned "
                                 f"{value.numel()} elements; expected {bucket.numel}")
            master.copy_(value.reshape(-1))
            exp_avg.zero_()
            exp_avg_sq.zero_()
        self._run(list(range(len(self.buckets))), fill, read=False)

    def write_shard(self, index: int, master: torch.Tensor) -> None:
        """Set shard `index`'s fp32 master to `master` (shard-sized, any float dtype) and its
        moments to zero, a bucket at a time; the other shards keep theirs."""
        if master.numel() != self.shard_sizes[index]:
            raise ValueError(f"shard {index} has {self.shard_sizes[index]} elements; got {master.numel()}")
        flat = master.reshape(-1)
        self.abandon(index, restore=False)

        def fill(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
            views = bucket_views(buffer, bucket.numel)
            views[0].copy_(flat[bucket.start:bucket.stop])
            views[1].zero_()
            views[2].zero_()
        self._run([k for k, b in enumerate(self.buckets) if b.shard == index], fill, read=False)

    def copy_masters_to(self, outputs: Sequence[Optional[torch.Tensor]]) -> None:
        """Copy each shard's master into `outputs[i]` (cast to its dtype; None skips it)."""
        self._check_sizes(outputs, "outputs", allow_none=True, contiguous=True)
        self.wait_speculation()
        wanted = [i for i, b in enumerate(self.buckets) if outputs[b.shard] is not None]

        def copy(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
            master = bucket_views(buffer, bucket.numel)[0]
            outputs[bucket.shard].reshape(-1)[bucket.start:bucket.stop].copy_(master)
        self._run(wanted, copy, write=False)

    def state_dict(self) -> dict:
        """The state as views of the file (memory maps): nothing is read until a value is
        used, and what is read is file-backed page cache, not process memory. `buckets[k]`
        holds bucket k's "master", "exp_avg" and "exp_avg_sq"; `layout` its (shard, start,
        stop). The views show the file as it is (each bucket's current slot), so they are
        current until the next step."""
        self.wait_speculation()
        self._check_usable()
        buckets = []
        for bucket in self.buckets:
            floats = self.file.map(bucket)
            n = bucket.numel
            buckets.append({name: floats[i * n:(i + 1) * n] for i, name in enumerate(STATE_NAMES)})
        return {"layout": [(b.shard, b.start, b.stop) for b in self.buckets], "buckets": buckets}

    def map_range(self, shard: int, start: int, stop: int) -> Optional[tuple[torch.Tensor, ...]]:
        """Elements [start, stop) of shard `shard` as (master, exp_avg, exp_avg_sq) maps of the
        file, each over those elements alone (`StateFile.map_elements`); None when they do not
        lie inside one bucket. Given also while the state is inconsistent: a checkpoint load
        writes through them to make it whole again. The current slot's: a step that commits a
        speculation moves it (see [Note: two slots per bucket]). It reads nothing: a reader of
        the map flushes the writes behind first (`flush`)."""
        self._wait_worker()
        self._check_open()
        for bucket in self.buckets:
            if bucket.shard == shard and bucket.start <= start and stop <= bucket.stop:
                return self.file.map_elements(bucket, start - bucket.start, stop - bucket.start)
        return None

    def slot_of(self, shard: int, start: int, stop: int) -> Optional[int]:
        """The current slot of the bucket holding elements [start, stop) of shard `shard`, or
        None when they do not lie inside one bucket (as `map_range`)."""
        for bucket in self.buckets:
            if bucket.shard == shard and bucket.start <= start and stop <= bucket.stop:
                return self.file.slot(bucket)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """Write a state dict of `state_dict()`'s form (the same layout) into the file, one
        bucket at a time through the pipeline's buffers."""
        layout = [tuple(entry) for entry in state_dict.get("layout", ())]
        ours = [(b.shard, b.start, b.stop) for b in self.buckets]
        if layout != ours:
            raise ValueError(f"rank {self.file.rank}: the offloaded state dict has buckets {layout[:4]}... "
                             f"({len(layout)}) but this engine has {ours[:4]}... ({len(ours)}); shard sizes "
                             "and bucket_params must match")
        sources = state_dict["buckets"]
        for k, bucket in enumerate(self.buckets):
            for name in STATE_NAMES:
                value = sources[k].get(name)
                if value is None or value.numel() != bucket.numel:
                    raise ValueError(f"rank {self.file.rank}: bucket {k} of the offloaded state dict has "
                                     f"{name}={None if value is None else tuple(value.shape)}; expected "
                                     f"{bucket.numel} elements")

        def fill(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
            for view, name in zip(bucket_views(buffer, bucket.numel), STATE_NAMES):
                view.copy_(sources[k][name].reshape(-1))
        self.abandon(restore=False)
        self._broken = None           # a complete load makes the state whole again
        self._run(list(range(len(self.buckets))), fill, read=False)

    # -- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: Sequence[Optional[torch.Tensor]], segments: Iterable[Segment],
             resident: Optional[Sequence[Optional[torch.Tensor]]] = None,
             on_bucket: Optional[Callable[[Bucket], None]] = None) -> None:
        """One AdamW step of every segment, pipelined through the file.

        `grads[i]`: shard i's gradient (float32, bfloat16 or float16, shard-sized); `segments`:
        which elements are stepped with which settings (elements in no segment keep their
        state, as a parameter without a gradient does in torch); `resident[i]`: where shard i's
        updated master is copied (e.g. the 16-bit shard the all-gather sends), or None;
        `on_bucket(bucket)` is called once a bucket's resident copy is written, before the next
        bucket is stepped (the disk tier queues that part's copy to the device there, so that it
        runs while the next bucket is updated). Buckets with no segment are neither read nor
        written.

        Speculations of earlier in this step (`speculate`) are settled first: each one whose
        inputs equal this step's is committed and its buckets are not stepped again; the
        others are recomputed here, and their buckets this step does not write get their
        resident copy restored from the current masters.
        """
        self.wait_speculation()
        self._check_sizes(grads, "grads", allow_none=True, contiguous=True)
        if resident is not None:
            self._check_sizes(resident, "resident", allow_none=True, contiguous=True)
        segments = list(segments)
        pieces = self._pieces(segments, grads)
        start = _Clock.now()
        committed = self._settle(grads, segments, pieces)
        wanted = [k for k in range(len(self.buckets)) if pieces[k] and k not in committed]
        held = [k for k in self.window.held() if k in set(wanted)]
        streamed = [k for k in wanted if not self.window.holds(k)]
        clock = _Clock()
        update = self._updater(pieces, grads, resident, on_bucket, clock)
        try:
            self._run(streamed, update, spare=True)
            streamed += self._step_held(held, update)
        except BaseException as e:
            # The file holds the state before the step, but `resident` is part new, part old.
            self._broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.window.drop()            # buckets read ahead that this step did not step
        for k in wanted:
            self.file.flip(self.buckets[k])
        total = _Clock.now() - start
        self.last_step = StepTimes(total, clock.seconds, sum(2 * self.buckets[k].nbytes for k in streamed))

    def _step_held(self, held: Sequence[int], update: Callable[[int, Bucket, torch.Tensor], None]) -> list[int]:
        """Step the buckets read ahead into the window, in the order they were read, each
        written behind into its spare slot (see [Note: reading ahead and writing behind] in
        window.py); those whose read failed go through the pipeline. The buckets streamed."""
        self._wait_for_pins([(k, 1 - self.file.slot(self.buckets[k])) for k in held])
        streamed = []
        for k in held:
            bucket, buffer = self.buckets[k], self.window.take(k)
            if buffer is None:
                self._run([k], update, spare=True)
                streamed.append(k)
            else:
                update(k, bucket, buffer)
                self.window.write_behind(k, bucket, buffer, 1 - self.file.slot(bucket))
        return streamed

    def _updater(self, pieces: list, grads: Sequence[Optional[torch.Tensor]],
                 resident: Optional[Sequence[Optional[torch.Tensor]]], on_bucket: Optional[Callable[[Bucket], None]],
                 clock: "_Clock") -> Callable[[int, Bucket, torch.Tensor], None]:
        """The pipeline's work for a step: the kernel on each piece of the bucket, then its
        resident copy and `on_bucket`."""

        def update(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
            with clock:
                master, exp_avg, exp_avg_sq = bucket_views(buffer, bucket.numel)
                grad = grads[bucket.shard].reshape(-1)
                for lo, hi, hyper in pieces[k]:
                    a, b = lo - bucket.start, hi - bucket.start
                    adamw_step(master[a:b], grad[lo:hi], exp_avg[a:b], exp_avg_sq[a:b], lr=hyper.lr,
                               betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, step=hyper.step,
                               maximize=hyper.maximize, backend=self.backend)
                if resident is not None and resident[bucket.shard] is not None:
                    resident[bucket.shard].reshape(-1)[bucket.start:bucket.stop].copy_(master)
                if on_bucket is not None:
                    on_bucket(bucket)
        return update

    # -- speculative steps (see [Note: the speculative step]) ------------------------------
    def speculate(self, shard: int, grad: torch.Tensor, segments: Iterable[Segment], resident: Optional[torch.Tensor],
                  *, on_bucket: Callable[[Bucket], None], before_write: Callable[[], None],
                  restored: Callable[[], None], ready: Optional[Callable[[], None]] = None) -> bool:
        """Start stepping shard `shard`'s `segments` with `grad` on the worker thread, into the
        spare slots (after `ready()`, run there: e.g. waiting for the gradient's copy), writing
        `resident` and calling `on_bucket` as `step` does, and `before_write()` before the
        first write of `resident`. `restored()` is called when the speculation is dropped and
        `resident` restored. Whether it was started: not for a shard already speculated, nor
        on a closed or inconsistent state."""
        own = shard_segments(segments, shard)
        if not own or shard in self._speculations or self._broken is not None or self.file.fd < 0:
            return False
        grads: list[Optional[torch.Tensor]] = [None] * len(self.shard_sizes)
        grads[shard] = grad
        pieces = self._pieces(own, grads)
        buckets = [k for k, p in enumerate(pieces) if p]
        record = Speculation(shard, own, grad, grad._version, buckets, resident, before_write, restored)
        if shard in self._reading_ahead and self.window.capacity > 0:
            record.ahead = True
            self._read_ahead(buckets)
        else:
            record.future = self._worker.submit(self._speculative_step, record, pieces, grads, on_bucket, ready,
                                                self.window.pending(buckets))
        self._speculations[shard] = record
        return True

    def _read_ahead(self, buckets: Sequence[int]) -> None:
        """Read `buckets` ahead into the window, then every other bucket of the shards that read
        ahead, last first (the order backward reduces them): the state does not wait for the
        gradient, so the groups reduced at the end of backward need not be read after it."""
        others = [k for k in reversed(range(len(self.buckets))) if self.buckets[k].shard in self._reading_ahead]
        for k in [*buckets, *others]:
            self.window.read_ahead(k, self.buckets[k])

    def _speculative_step(self, record: Speculation, pieces: list, grads: list, on_bucket: Callable[[Bucket], None],
                          ready: Optional[Callable[[], None]], behind: Sequence[Future]) -> None:
        """On the worker thread: one shard's step into its buckets' spare slots, once the
        writes behind into their current slots (`behind`) finished."""
        start = _Clock.now()
        with torch.no_grad():
            for write in behind:
                write.result()
            if ready is not None:
                ready()
            record.before_write()
            resident: list[Optional[torch.Tensor]] = [None] * len(self.shard_sizes)
            resident[record.shard] = record.resident
            self._run(record.buckets, self._updater(pieces, grads, resident, on_bucket, _Clock()), spare=True)
        record.seconds = _Clock.now() - start

    def speculating(self, shard: int) -> bool:
        """Whether shard `shard` has a speculation that no step has settled yet."""
        return shard in self._speculations

    def wait_speculation(self) -> None:
        """Wait until the worker has finished every speculation started (their errors are kept:
        a speculation that failed is recomputed by the step), and flush the writes behind."""
        self._wait_worker()
        self.flush()

    def flush(self) -> None:
        """Wait for the writes behind the last step (see [Note: reading ahead and writing
        behind] in window.py), before anything reads the file; one that failed makes the state
        inconsistent, as a failed step does."""
        error = self.window.flush()
        if error is not None and self._broken is None:
            self._broken = f"a write behind the step failed: {type(error).__name__}: {error}"

    def _wait_worker(self) -> None:
        """Wait until the worker has finished every speculation started."""
        for record in self._speculations.values():
            if record.future is not None:
                record.failed = record.future.exception()
                record.future = None
                self.speculated_s += record.seconds

    def abandon(self, shard: Optional[int] = None, *, restore: bool = True) -> None:
        """Drop the speculation of `shard` (of every shard when None), restoring its resident
        copy from the current masters (with `restore`, and where the state is consistent), then
        telling the disk tier (`restored`); its buckets read ahead leave the window."""
        self.wait_speculation()
        self.window.drop([k for k, b in enumerate(self.buckets) if shard is None or b.shard == shard])
        for index in list(self._speculations) if shard is None else [shard]:
            record = self._speculations.pop(index, None)
            if record is not None:
                self._drop(record, record.buckets if restore and self._broken is None else ())
                if not record.ahead:
                    self.restores += 1

    def _drop(self, record: Speculation, restore: Sequence[int]) -> None:
        """Restore the resident copy of buckets `restore` of a dropped speculation (one that
        read ahead wrote nothing: its buckets leave the window)."""
        if record.ahead:
            self.window.drop(record.buckets)
            return
        if restore and record.resident is not None:
            record.before_write()
            target = record.resident.reshape(-1)

            def copy(k: int, bucket: Bucket, buffer: torch.Tensor) -> None:
                target[bucket.start:bucket.stop].copy_(bucket_views(buffer, bucket.numel)[0])
            with torch.no_grad():
                self._run(list(restore), copy, write=False)
        record.restored()

    def _settle(self, grads: Sequence[Optional[torch.Tensor]], segments: list[Segment], pieces: list) -> set[int]:
        """Commit the speculations this step agrees with, drop the others (restoring what this
        step will not rewrite); the buckets committed."""
        committed: set[int] = set()
        for shard, record in list(self._speculations.items()):
            del self._speculations[shard]
            holds = record.holds_for(grads[shard], shard_segments(segments, shard))
            if record.ahead:
                # Its buckets stay in the window for this step; a speculation would have held.
                if holds:
                    self._reading_ahead.discard(shard)
                self.read_aheads += 1
            elif holds:
                for k in record.buckets:
                    self.file.flip(self.buckets[k])
                committed.update(record.buckets)
                self.commits += 1
            else:
                if any(pieces[k] for k in record.buckets):
                    self.recomputes += 1
                    self._reading_ahead.add(shard)
                else:
                    self.restores += 1
                self._drop(record, [k for k in record.buckets if not pieces[k]])
        return committed

    def _pieces(self, segments: Iterable[Segment], grads: Sequence[Optional[torch.Tensor]]):
        """Per bucket: the (start, stop, hyper) pieces of segments inside it, in shard elements."""
        by_shard: dict[int, list[int]] = {}
        for k, b in enumerate(self.buckets):
            by_shard.setdefault(b.shard, []).append(k)
        pieces: list[list] = [[] for _ in self.buckets]
        for seg in segments:
            if not (0 <= seg.shard < len(self.shard_sizes) and 0 <= seg.start <= seg.stop
                    <= self.shard_sizes[seg.shard]):
                raise ValueError(f"segment {seg} lies outside the shards {self.shard_sizes}")
            if grads[seg.shard] is None:
                raise ValueError(f"segment {seg} is to be stepped but shard {seg.shard} has no gradient")
            for k in by_shard.get(seg.shard, ()):
                b = self.buckets[k]
                lo, hi = max(b.start, seg.start), min(b.stop, seg.stop)
                if lo < hi:
                    pieces[k].append((lo, hi, seg.hyper))
        return pieces

    def _check_sizes(self, tensors: Sequence[Optional[torch.Tensor]], what: str, allow_none: bool = False,
                     contiguous: bool = False) -> None:
        """Shard-sized CPU tensors, `contiguous` where asked: a strided one would be flattened
        into a copy for every bucket, and writes into it lost."""
        if len(tensors) != len(self.shard_sizes):
            raise ValueError(f"{what}: {len(tensors)} tensors for {len(self.shard_sizes)} shards")
        for i, (t, size) in enumerate(zip(tensors, self.shard_sizes)):
            if t is None and allow_none:
                continue
            if t is None or t.numel() != size or t.device.type != "cpu":
                raise ValueError(f"{what}[{i}] is {None if t is None else (tuple(t.shape), str(t.device))}; "
                                 f"expected a CPU tensor of {size} elements")
            if contiguous and not t.is_contiguous():
                raise ValueError(f"{what}[{i}] is not contiguous; the engine reads and writes shards through flat "
                                 "views")

    # -- pins (see [Note: saves streamed from the state file]) -----------------------------
    def pin(self) -> "Pin":
        """Keep every bucket's current slot as it is until the returned pin is released."""
        self.wait_speculation()
        pin = Pin({k: self.file.slot(bucket) for k, bucket in enumerate(self.buckets)})
        with self._lock:
            self._pins.append(pin)
        return pin

    def wait_pins(self) -> None:
        """Block until every pin is released and the writes behind are flushed (before a load
        writes the current slots through maps)."""
        self.flush()
        self._wait_for_pins(None)

    def _wait_for_pins(self, targets: Optional[Sequence[tuple[int, int]]]) -> None:
        """Block until no pin holds any of `targets` ((bucket, slot) pairs; None: any)."""
        with self._lock:
            pins = list(self._pins)
        for pin in pins:
            if targets is None or any(pin.slots.get(k) == slot for k, slot in targets):
                pin.released.wait()
        with self._lock:
            self._pins = [pin for pin in self._pins if not pin.released.is_set()]

    def close(self) -> None:
        """Stop the threads and remove the state file."""
        self._worker.shutdown(wait=True)
        self.window.flush()
        self.window.drop()
        self._speculations.clear()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.file.close()


@dataclass
class Pin:
    """The slot of each bucket (by index) an asynchronous save reads; `release()` once its
    files are written."""

    slots: dict[int, int]
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


@dataclass(frozen=True)
class PagedParam:
    """Where a parameter of a disk-offloaded model lives: elements [start, stop) of shard
    `shard` of `engine`; `resident` is that shard's 16-bit copy (the parameter is a view of
    it), `grad_shard()` its fp32 gradient shard (`.grad` is a view of it); `before_step` is
    called before a step writes `resident`, `on_bucket` told each bucket of it the step
    wrote, as soon as it is written, and `on_stepped` after the step."""

    engine: PagedAdamW
    shard: int
    start: int
    stop: int
    resident: torch.Tensor
    grad_shard: Callable[[], Optional[torch.Tensor]]
    on_stepped: Callable[[torch.Tensor], None]
    on_bucket: Callable[[Bucket], None]
    before_step: Callable[[], None]


# The attribute that marks a parameter whose master and moments are paged, for
# overlap.optim.AdamW to find; it lives and dies with the parameter.
_PAGED_ATTR = "_overlap_paged"


def register_paged(param: torch.Tensor, where: PagedParam) -> None:
    setattr(param, _PAGED_ATTR, where)


def paged_of(param: torch.Tensor) -> Optional[PagedParam]:
    """Where `param`'s master and moments are paged, or None for an ordinary parameter."""
    return getattr(param, _PAGED_ATTR, None)


@dataclass(frozen=True)
class StepTimes:
    """The last step: wall seconds, seconds in the kernel (and resident copies), bytes it read
    and wrote itself (not those read ahead or written behind it)."""

    total_s: float
    update_s: float
    io_bytes: int


class _Clock:
    """Adds up the seconds spent inside `with` blocks."""

    now = staticmethod(__import__("time").perf_counter)

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._start = self.now()

    def __exit__(self, *exc) -> None:
        self.seconds += self.now() - self._start
