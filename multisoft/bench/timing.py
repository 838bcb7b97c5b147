"""How one call is timed on the GPU: CUDA events, the L2 cache flushed before each call, the median kept."""

from __future__ import annotations

import statistics
import time
from typing import Callable

# How many times longer than the host's measured time to queue a batch the GPU is held before it, and how far a
# batch whose hold ran out may double it (past that, as for a call that synchronises inside, the times are kept).
HOLD_MARGIN = 1.5
HOLD_MARGIN_MAX = 24.0
FLUSH_BYTES = 256 << 20  # zeroed before each timed call: more than the L2 of any GPU this targets
# The eager timing follows the kernel timing of the same call, which has warmed it up: a short warm-up, and a shorter
# rep than the kernel timing's, for the run's time (a median of at least 10 ms of calls).
EAGER_WARMUP_MS = 2.0
EAGER_REP_MS = 10.0

_sleep_cycles_per_ms: list[float] = []


def make_timer(warmup: float, rep: float, kind: str = "do_bench") -> tuple[Callable, str]:
    """A function fn -> median milliseconds, and a description of how it times.

    ``do_bench``: triton.testing.do_bench (event_bench without triton).
    ``queued``: queued_bench, which keeps the host's launch time out of the result.
    """
    settings = f"median, L2 cleared between reps, warmup {warmup:g} ms, rep {rep:g} ms"
    if kind == "queued":
        return (lambda fn: queued_bench(fn, warmup, rep)), f"queued CUDA events, host time hidden ({settings})"
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001 - a broken triton install must not stop the benchmark
        return (lambda fn: event_bench(fn, warmup, rep)), f"torch.cuda.Event ({settings})"
    return (lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))), \
        f"triton.testing.do_bench ({settings})"


def make_eager_timer(kernel_kind: str, rep: float = EAGER_REP_MS) -> tuple[Callable | None, str]:
    """The timer of the eager wall time (do_bench: host time included, L2 flushed between reps) and how it times;
    None when the kernel timer ``kernel_kind`` is do_bench already: the eager time is then the kernel time."""
    if kernel_kind == "do_bench":
        return None, "the kernel timing (--timer do_bench)"
    return make_timer(EAGER_WARMUP_MS, rep, "do_bench")


def _hold_gpu(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds (torch.cuda._sleep, calibrated once)."""
    import torch

    if not _sleep_cycles_per_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _sleep_cycles_per_ms.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms[0]))


def queued_bench(fn: Callable, warmup: float, rep: float, max_batch: int = 32) -> float:
    """Median CUDA-event time of ``fn`` with its host time hidden, L2 flushed before each call.

    Before each batch of calls the GPU is held busy (a sleep kernel) for as long
    as the host needs to queue the batch, so every call finds the previous one's
    work queued behind it: the events time the GPU work, not the Python launching
    it. A call that the GPU began before the host had queued all of it (the hold
    ran out: the host was slower than measured, or the sleep shorter) timed the
    host too: it is left out and the next batches are held twice as long. A call
    that synchronises inside still waits for the host.
    """
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    _hold_gpu(20.0)
    start = time.perf_counter()
    for _ in range(3):
        flush.zero_()
        fn()
    host_ms = (time.perf_counter() - start) * 1e3 / 3 + 0.02  # + the events' launches
    torch.cuda.synchronize()
    wall_ms = max(host_ms, statistics.median(_events_times(fn, flush, 3, 4.5 * host_ms)[0]))
    for _ in range(max(1, int(warmup / wall_ms))):
        fn()
    total = max(10, min(1000, int(rep / wall_ms)))
    batch = max(1, min(max_batch, int(40.0 / host_ms)))
    margin = HOLD_MARGIN
    clean = margin <= HOLD_MARGIN_MAX
    times: list[float] = []
    while len(times) < total:
        count = min(batch, total - len(times))
        kept, waited = _events_times(fn, flush, count, margin * count * host_ms, clean_only=clean)
        if clean and len(kept) < count:
            if waited:   # the host waited out the hold: a call that synchronises, which no longer hold would help
                clean = False
            else:
                margin *= 2
                clean = margin <= HOLD_MARGIN_MAX
        times += kept
    return statistics.median(times)


def _events_times(fn: Callable, flush, count: int, hold_ms: float = 0.0,
                  clean_only: bool = False) -> tuple[list[float], bool]:
    """CUDA-event times of ``count`` calls, L2 flushed before each, the GPU first held ``hold_ms``; and whether
    the host took at least the hold to queue them (it waited on the GPU: a call that synchronises).

    ``clean_only``: only the calls that the GPU began after the host had queued all of their work (their start
    event ran later, from a mark recorded on the idle stream, than the host took to queue them): the others timed
    the host as well."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    mark = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    mark.record()
    marked = time.perf_counter()
    if hold_ms:
        _hold_gpu(hold_ms)
    queued = []
    for first, last in zip(starts, ends):
        flush.zero_()
        first.record()
        fn()
        last.record()
        queued.append((time.perf_counter() - marked) * 1e3)
    torch.cuda.synchronize()
    times = [first.elapsed_time(last) for first, last, host_ms in zip(starts, ends, queued)
             if not clean_only or mark.elapsed_time(first) > host_ms]
    return times, bool(hold_ms) and queued[-1] >= hold_ms


def event_bench(fn: Callable, warmup: float, rep: float) -> float:
    """do_bench without triton: warm up, then the median of CUDA-event times, L2 flushed before each."""
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    return statistics.median(_events_times(fn, flush, max(1, int(rep / estimate)))[0])


LONG_CALL_REP_MS = 1000.0
LONG_CALL_COUNTS = (3, 10)  # the fewest and the most calls long_call_ms times


def long_call_ms(fn: Callable, rep: float = LONG_CALL_REP_MS) -> float:
    """Median CUDA-event time of a long call (tens of milliseconds to seconds: a training step of a model's last
    layer), the L2 cache flushed before each: a warm-up call, one call that sizes the count, then as many calls as
    fit in ``rep`` ms, within LONG_CALL_COUNTS. queued_bench's 17 calls or more of a one-second call would take
    most of a run; and the GPU's work on a call this long hides the host's launching of the next one (unless the
    call synchronises inside, when the host is timed too, as it is then in any training step)."""
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    estimate = max(_events_times(fn, flush, 1)[0][0], 1e-3)
    fewest, most = LONG_CALL_COUNTS
    return statistics.median(_events_times(fn, flush, max(fewest, min(most, int(rep / estimate))))[0])


def wall_us_per_call(fn: Callable, calls: int) -> float:
    """Host wall-clock microseconds per call over ``calls`` calls (after 20 unmeasured), synchronised only
    before the first and after the last."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def recover() -> None:
    """After a failed call: wait for the GPU and return its cached memory (e.g. after running out of it)."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken context is reported by the next measurements
        pass


def first_call_ms(fn: Callable) -> float:
    """Wall time of one synchronised call (the first: it includes compiling)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def case_inputs(runner, op: str, dtype_name: str, records: list, reason: str, make: Callable):
    """A case's inputs, ``make()``, unless ``reason`` (why the case is skipped) or making them fails (out of
    memory, an exception): then every record gets that as its note, the progress steps past them, and None is
    returned."""
    from .records import describe_error

    if not reason:
        try:
            return make()
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: every record gets the note
            reason = describe_error(error)
            recover()
    for record in records:
        runner.progress.step(f"{op} {dtype_name} {record.shape} {record.impl}")
        record.note = reason
    return None
