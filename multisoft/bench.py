"""``python -m multisoft bench``: every op on every backend, against the copy bandwidth.

Times forward, backward and forward+backward of softmax, log_softmax,
cross_entropy and blocksparse_softmax on each backend that can run here, next
to torch's own ops and Liger-Kernel's (when importable), with CUDA events
(``triton.testing.do_bench``, median, L2 cleared between repetitions). Each
result is given in GB/s and as a fraction of a device-to-device copy measured
in the same run. Also: peak memory of cross-entropy forward+backward, the first
(compiling) call of each backend, and the host overhead of the front. Writes
CSV files, ``results.md`` and PNG plots (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, get_type_hints

OPS = ("softmax", "log_softmax", "cross_entropy", "blocksparse_softmax")
OP_ALIASES = {"blocksparse": "blocksparse_softmax", "ce": "cross_entropy"}
KERNEL_MODULE = {"softmax": "softmax", "log_softmax": "softmax", "cross_entropy": "cross_entropy",
                 "blocksparse_softmax": "blocksparse"}
DIRECTIONS = ("forward", "backward", "forward+backward")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}

# Bytes moved per input element: softmax reads x and writes y (2), its backward reads y, dy and
# writes dx (3); cross-entropy reads the logits (1), its backward reads them and writes the gradient (2).
TRAFFIC = {
    "softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "log_softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "blocksparse_softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "cross_entropy": {"forward": 1, "backward": 2, "forward+backward": 3},
}

HEADLINE = [(32768, 1024), (16384, 4096), (4096, 32768), (1024, 131072), (512, 262144)]
CROSS_ENTROPY = [(8192, 32000), (8192, 128256), (4096, 262144)]
SWEEP_ELEMENTS = 1 << 26
SWEEP_COLS = [1 << k for k in range(8, 21)]
HEADS, SEQ, SCALE = 16, 4096, 0.125
LAYOUTS = ([(block, 0.25, causal) for block in (16, 32, 64, 128) for causal in (False, True)]
           + [(64, density, causal) for density in (0.10, 0.50) for causal in (False, True)])

QUICK_HEADLINE = [(16384, 4096), (1024, 131072)]
QUICK_SWEEP_COLS = [1024, 32768, 1 << 20]
QUICK_CROSS_ENTROPY = [(8192, 32000)]
QUICK_LAYOUTS = [(64, 0.25, False), (64, 0.25, True)]

# The backends' speed targets (the issues'), as a fraction of the copy bandwidth: this many for these backends
# (None: none, the reference), DEFAULT_TARGET for any other, over the directions of each op that TARGET_DIRECTIONS
# names, on the headline shapes, the cross-entropy shapes and the block-sparse layouts.
TARGETS = {"numba": 0.80, "torch": None}
DEFAULT_TARGET = 0.90
TARGET_DIRECTIONS = {"softmax": ("forward", "backward"), "log_softmax": ("forward", "backward"),
                     "cross_entropy": ("forward+backward",), "blocksparse_softmax": ("forward", "backward")}
SHORTFALL_REASONS = "benchmarks/README.md, \"Where the targets are not met yet\""
# Why cells fall short of a target, as measured: rows of impl, op, direction, dtype, shape (fnmatch patterns) and why;
# the first row that matches a cell below its target gives that cell's note in results.md.
SHORTFALLS = "benchmarks/shortfalls.csv"
NO_REASON = "no reason on record"
ENVIRONMENT_FILE = "environment.json"

TORCH_PEER = "torch-native"
LIGER_PEER = "liger"
COPY_BYTES = 1 << 30
NO_GPU_MESSAGE = "multisoft bench: no CUDA device found; the benchmark needs one (nothing was run)."
DEVICE = "cuda"  # the tests' dry run sets "cpu"
COPY_AT_END = "copy bandwidth at the end"


# -- records


@dataclasses.dataclass
class Timing:
    op: str
    impl: str
    role: str  # "backend", "peer" or "copy"
    dtype: str
    group: str  # "headline", "sweep", "headline,sweep" or "layout"
    shape: str
    n: int  # row length, for the sweep plots (0 for block-sparse)
    direction: str
    ms: float | None = None
    bytes: int = 0
    gb_per_s: float | None = None
    fraction_of_copy: float | None = None
    note: str = ""


@dataclasses.dataclass
class MemoryRecord:
    impl: str
    dtype: str
    shape: str
    peak_mib: float | None
    logits_mib: float
    note: str = ""


@dataclasses.dataclass
class FirstCall:
    impl: str
    op: str
    direction: str
    dtype: str
    shape: str
    first_call_ms: float
    steady_ms: float | None = None


@dataclasses.dataclass
class Overhead:
    impl: str
    api_us: float | None
    direct_us: float | None
    note: str = ""

    @property
    def difference_us(self) -> float | None:
        if self.api_us is None or self.direct_us is None:
            return None
        return self.api_us - self.direct_us


@dataclasses.dataclass
class Shortfall:
    """Why the cells that match these patterns (fnmatch, "|" between alternatives, on Timing's fields) fall short
    of their target."""

    impl: str
    op: str
    direction: str
    dtype: str
    shape: str
    why: str

    def matches(self, timing: Timing) -> bool:
        return all(any(fnmatch.fnmatchcase(getattr(timing, name), pattern)
                       for pattern in getattr(self, name).split("|")) for name in SHORTFALL_COLUMNS[:-1])


SHORTFALL_COLUMNS = tuple(field.name for field in dataclasses.fields(Shortfall))  # a shortfalls CSV's header


def first_shortfall(shortfalls: list[Shortfall], timing: Timing) -> Shortfall | None:
    """The shortfall that gives ``timing`` its reason: the first that matches it."""
    return next((s for s in shortfalls if s.matches(timing)), None)


def load_shortfalls(path: Path) -> list[Shortfall] | None:
    """The rows of a shortfalls CSV (SHORTFALL_COLUMNS), or None when there is no such file."""
    if not path.exists():
        return None
    with open(path, newline="") as handle:
        reader = csv.DictReader(row for row in handle if not row.startswith("#"))
        if tuple(reader.fieldnames or ()) != SHORTFALL_COLUMNS:
            raise ValueError(f"{path}: the columns must be {','.join(SHORTFALL_COLUMNS)}, got "
                             f"{','.join(reader.fieldnames or ())}")
        rows = list(reader)
    for number, row in enumerate(rows, start=2):
        if None in row or any(not row[name] for name in SHORTFALL_COLUMNS):
            raise ValueError(f"{path}: row {number} (comments not counted) needs a value in each of "
                             f"{', '.join(SHORTFALL_COLUMNS)}")
    return [Shortfall(**row) for row in rows]


@dataclasses.dataclass
class Results:
    environment: dict
    copy_gb_per_s: float | None
    timings: list[Timing] = dataclasses.field(default_factory=list)
    memory: list[MemoryRecord] = dataclasses.field(default_factory=list)
    first_calls: list[FirstCall] = dataclasses.field(default_factory=list)
    overhead: list[Overhead] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Case:
    """One input of one op: a dense (M, N) shape or a block-sparse layout."""

    op: str
    group: str
    label: str
    shape: tuple
    elements: int
    n: int = 0
    layout: object = None  # block-sparse: the (H, Mb, Nb) layout tensor
    block: int = 0
    causal: bool = False


# -- pure arithmetic and planning


def bytes_moved(op: str, direction: str, elements: int, element_size: int) -> int:
    """The bytes an op must read and write for ``elements`` input elements (see TRAFFIC)."""
    return TRAFFIC[op][direction] * elements * element_size


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def sweep_shapes(cols: list[int]) -> list[tuple[int, int]]:
    """(M, N) for each N with M * N = SWEEP_ELEMENTS (64M elements)."""
    return [(max(1, SWEEP_ELEMENTS // n), n) for n in cols]


def dense_cases(op: str, headline: list, sweep: list) -> list[Case]:
    """The headline shapes, then the sweep's other shapes; a shape in both is measured once."""
    cases = []
    for rows, cols in dict.fromkeys(headline + sweep):
        group = ",".join(name for name, shapes in (("headline", headline), ("sweep", sweep))
                         if (rows, cols) in shapes)
        cases.append(Case(op, group, f"{rows}x{cols}", (rows, cols), rows * cols, n=cols))
    return cases


def make_layout(block: int, density: float, causal: bool, heads: int, seq: int, seed: int = 0):
    """A random 0/1 layout (heads, seq/block, seq/block) of about ``density`` of all blocks, diagonal kept.

    A causal layout draws its blocks from the lower triangle only, so that it
    also keeps about ``density`` of the full grid.
    """
    import torch

    blocks = seq // block
    generator = torch.Generator().manual_seed(seed)
    chance = min(1.0, 2 * density) if causal else density
    layout = torch.rand(heads, blocks, blocks, generator=generator) < chance
    layout |= torch.eye(blocks, dtype=torch.bool)
    if causal:
        layout &= torch.ones(blocks, blocks, dtype=torch.bool).tril()
    return layout.to(torch.int64)


def blocksparse_cases(layouts: list) -> list[Case]:
    """One case per (block, density, causal), with Z (1..4) chosen for 64M+ elements."""
    cases = []
    for seed, (block, density, causal) in enumerate(layouts):
        layout = make_layout(block, density, causal, HEADS, SEQ, seed=seed)
        nnz = int(layout.sum())
        per_batch = nnz * block * block
        batch = max(1, min(4, math.ceil(SWEEP_ELEMENTS / per_batch)))
        actual = nnz / layout.numel()
        label = f"b{block} {actual:.0%}{' causal' if causal else ''} Z{batch}"
        cases.append(Case("blocksparse_softmax", "layout", label, (batch, nnz, block, block), batch * per_batch,
                          layout=layout, block=block, causal=causal))
    return cases


def plan_cases(ops: list[str], quick: bool) -> dict[str, list[Case]]:
    headline = QUICK_HEADLINE if quick else HEADLINE
    sweep = sweep_shapes(QUICK_SWEEP_COLS if quick else SWEEP_COLS)
    plan = {}
    for op in ops:
        if op in ("softmax", "log_softmax"):
            plan[op] = dense_cases(op, headline, sweep)
        elif op == "cross_entropy":
            shapes = QUICK_CROSS_ENTROPY if quick else CROSS_ENTROPY
            plan[op] = dense_cases(op, shapes, [])
        else:
            plan[op] = blocksparse_cases(QUICK_LAYOUTS if quick else LAYOUTS)
    return plan


# -- the command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m multisoft bench",
        description="Time every op on every backend (and torch / Liger-Kernel as peers) against the copy "
                    "bandwidth; write CSV, Markdown and PNG plots. Needs a CUDA GPU.")
    parser.add_argument("--out", default="benchmarks/results", help="output folder (default: %(default)s)")
    parser.add_argument("--ops", help=f"comma-separated ops (default: all of {', '.join(OPS)})")
    parser.add_argument("--backends", help="comma-separated backends (default: all that can run here)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated of fp32, bf16, fp16 "
                                                              "(default: %(default)s)")
    parser.add_argument("--fp16", action="store_true", help="also time float16")
    parser.add_argument("--quick", action="store_true", help="a few shapes only: a fast smoke run")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--no-peers", action="store_true", help="do not time torch's or Liger-Kernel's ops")
    parser.add_argument("--timer", choices=("do_bench", "queued"), default="queued",
                        help="do_bench: triton.testing.do_bench; queued: CUDA events with the GPU held busy while "
                             "the host queues the calls, so host overhead is not timed (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=5.0, help="do_bench warm-up in ms (default %(default)g)")
    parser.add_argument("--rep", type=float, default=25.0, help="do_bench repetition time in ms "
                                                                "(default %(default)g)")
    parser.add_argument("--shortfalls", default=SHORTFALLS,
                        help="CSV of why cells fall short of their target, for results.md (default: %(default)s; "
                             "none if it does not exist)")
    parser.add_argument("--report-only", action="store_true",
                        help="time nothing: write results.md (and the plots) again from the CSV files and "
                             f"{ENVIRONMENT_FILE} in --out, e.g. after editing --shortfalls")
    args = parser.parse_args(argv)
    args.ops = _choices(args.ops, OPS, OP_ALIASES, "op", parser) if args.ops else list(OPS)
    args.dtypes = _choices(args.dtypes, tuple(DTYPES), DTYPE_ALIASES, "dtype", parser)
    if args.fp16 and "fp16" not in args.dtypes:
        args.dtypes.append("fp16")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    return args


def _choices(text: str, allowed: tuple, aliases: dict, what: str, parser) -> list[str]:
    chosen = []
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        item = aliases.get(item, item)
        if item not in allowed:
            parser.error(f"unknown {what} {item!r}; choose from {', '.join(allowed)}")
        if item not in chosen:
            chosen.append(item)
    return chosen


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success (also when there is no GPU: then it says so and does nothing)."""
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    out = Path(args.out)
    try:
        shortfalls = load_shortfalls(Path(args.shortfalls))
        results = read_results(out) if args.report_only else None
    except (OSError, ValueError) as error:
        print(f"multisoft bench: {error}", file=sys.stderr)
        return 2
    if args.report_only:  # the CSV files stay as the run wrote them
        written = [write_markdown(results, out, shortfalls)]
    else:
        import torch

        if not torch.cuda.is_available():
            print(NO_GPU_MESSAGE)
            return 0
        results = run(args)
        written = write_reports(results, out, shortfalls)
    if not args.no_plots:
        written += _write_plots(results, out)
    print(f"copy bandwidth: {results.copy_gb_per_s:.0f} GB/s" if results.copy_gb_per_s else "copy bandwidth: n/a")
    for path in written:
        print(f"wrote {path}")
    return 0


def _write_plots(results: Results, out: Path) -> list[Path]:
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots (pip install 'multisoft[bench]')", file=sys.stderr)
        return []
    from . import _plots

    try:
        return _plots.write_plots(results, out)
    except Exception as error:  # noqa: BLE001 - the CSV and Markdown are already written
        print(f"plots failed: {describe_error(error)}", file=sys.stderr)
        return []


# -- progress


class Progress:
    """tqdm when importable, else a one-line bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.start
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        sys.stderr.write(line[:120].ljust(120))
        sys.stderr.flush()

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            sys.stderr.write("\r" + " " * 120 + "\r" + message + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


# -- timing


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


_sleep_cycles_per_ms: list[float] = []


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


# How many times longer than the host's measured time to queue a batch the GPU is held before it, and how far a
# batch whose hold ran out may double it (past that, as for a call that synchronises inside, the times are kept).
HOLD_MARGIN = 1.5
HOLD_MARGIN_MAX = 24.0


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

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
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

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
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


def wall_us_per_call(fn: Callable, calls: int) -> float:
    """Host wall-clock per call over ``calls`` calls, with one synchronize at the end."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _first_call_ms(fn: Callable) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def describe_error(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return "error: " + text[:240]


# -- what is timed


class NotMeasured(Exception):
    """This implementation has no separate measurement for this direction (the message says why)."""


@dataclasses.dataclass
class Impl:
    """A backend or a peer: ``make(op, inputs)`` gives the function x -> output (a loss for cross-entropy)."""

    name: str
    role: str
    ops: tuple
    make: Callable
    inplace_ops: tuple = ()  # ops whose forward writes the gradient into x (no backward of their own)
    inplace_note: str = ""
    directions: tuple = DIRECTIONS  # what is timed of each op


def _backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        if op == "softmax":
            return lambda x: multisoft.softmax(x, backend=name)
        if op == "log_softmax":
            return lambda x: multisoft.log_softmax(x, backend=name)
        if op == "cross_entropy":
            target = inputs["target"]
            return lambda x: multisoft.cross_entropy(x, target, backend=name)
        layout, block, causal = inputs["layout"], inputs["block"], inputs["causal"]
        return lambda x: multisoft.blocksparse_softmax(x, layout, block, scale=SCALE, is_causal=causal,
                                                       backend=name)
    return Impl(name, "backend", OPS, make)


def _inplace_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        target = inputs["target"]
        return lambda x: multisoft.cross_entropy(x, target, backend=name, inplace_backward=True)
    return Impl(f"{name} inplace", "backend", ("cross_entropy",), make, inplace_ops=("cross_entropy",),
                inplace_note="inplace_backward's backward overwrites the logits", directions=("forward+backward",))


def _torch_peer() -> Impl:
    def make(op, inputs):
        import torch
        import torch.nn.functional as F

        if op == "softmax":
            return lambda x: torch.softmax(x, -1)
        if op == "log_softmax":
            return lambda x: torch.log_softmax(x, -1)
        target = inputs["target"]
        return lambda x: F.cross_entropy(x, target)
    return Impl(TORCH_PEER, "peer", ("softmax", "log_softmax", "cross_entropy"), make)


def liger_peer() -> tuple[Impl | None, str]:
    """Liger-Kernel's softmax and cross-entropy as a peer, or None and why not."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    ops, reasons = {}, []
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except Exception as error:  # noqa: BLE001 - any import failure just leaves the peer out
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss
        except Exception:  # noqa: BLE001
            reasons.append(f"cross-entropy: {describe_error(error)}")
        else:
            module = LigerCrossEntropyLoss()
            ops["cross_entropy"] = lambda target: (lambda x: module(x, target))
    else:
        def cross_entropy(target):
            def call(x):
                out = LigerCrossEntropyFunction.apply(x, target, None)
                return out[0] if isinstance(out, tuple) else out
            return call
        ops["cross_entropy"] = cross_entropy
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception as error:  # noqa: BLE001
        reasons.append(f"softmax: {describe_error(error)}")
    else:
        ops["softmax"] = lambda target: LigerSoftmaxFunction.apply
    if not ops:
        return None, f"{version}, not importable ({'; '.join(reasons)})"

    def make(op, inputs):
        return ops[op](inputs.get("target"))
    note = f"{version}" + (f" ({'; '.join(reasons)})" if reasons else "")
    return Impl(LIGER_PEER, "peer", tuple(ops), make, inplace_ops=("cross_entropy",),
                inplace_note="Liger computes the gradient in its forward"), note


def make_inputs(case: Case, dtype_name: str) -> dict:
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    x = torch.randn(case.shape, device=DEVICE, dtype=dtype)
    inputs = {"x": x}
    if case.op == "cross_entropy":
        inputs["target"] = torch.randint(0, case.shape[1], (case.shape[0],), device=DEVICE)
        inputs["grad"] = None
    else:
        inputs["grad"] = torch.randn_like(x)
    if case.op == "blocksparse_softmax":
        inputs.update(layout=case.layout, block=case.block, causal=case.causal)
    return inputs


def prepare(impl: Impl, op: str, direction: str, inputs: dict) -> Callable:
    """The zero-argument call to time for one direction (the backward reuses one forward's graph)."""
    import torch

    f = impl.make(op, inputs)
    x, grad = inputs["x"], inputs["grad"]
    if direction == "forward":
        return lambda: f(x)
    inplace = op in impl.inplace_ops
    if direction == "backward" and inplace:
        raise NotMeasured(impl.inplace_note)
    xg = (x.detach().clone() if inplace else x.detach()).requires_grad_(True)
    if direction == "backward":
        y = f(xg)
        return lambda: torch.autograd.grad(y, xg, grad, retain_graph=True)
    return lambda: torch.autograd.grad(f(xg), xg, grad)


# -- the run


class Runner:
    """What one run shares: the device, the timer, the first calls seen, the kernel modules that failed."""

    def __init__(self, args):
        import torch

        self.device = torch.device(DEVICE)
        self.timer, self.timing_method = make_timer(args.warmup, args.rep, args.timer)
        self.seen_first: set = set()
        self.failed_modules: dict = {}
        self.progress: Progress | None = None

    def skip_reason(self, impl: Impl, op: str, dtype_name: str) -> str:
        """Why ``impl`` cannot run ``op`` in ``dtype_name`` here; "" when it can."""
        if impl.role != "backend":
            return ""
        import torch

        from ._registry import get_backend

        name = impl.name.split()[0]
        try:
            backend = get_backend(name)
            reason = backend.unavailable_reason(self.device, getattr(torch, DTYPES[dtype_name]))
        except Exception as error:  # noqa: BLE001
            return describe_error(error)
        if reason:
            return f"unavailable: {reason}"
        key = (name, KERNEL_MODULE[op])
        if key not in self.failed_modules:
            try:
                backend.kernels(KERNEL_MODULE[op])
                self.failed_modules[key] = ""
            except Exception as error:  # noqa: BLE001 - a backend still being written must not stop the run
                self.failed_modules[key] = describe_error(error)
                self.note(f"{name} {op}: {self.failed_modules[key]}")
        return self.failed_modules[key]

    def note(self, message: str) -> None:
        if self.progress is not None:
            self.progress.note(message)
        else:
            print(message, file=sys.stderr)

    def measure(self, impl: Impl, case: Case, dtype_name: str, inputs: dict, copy_gb_per_s: float | None,
                results: Results) -> None:
        skip = self.skip_reason(impl, case.op, dtype_name)
        for direction in impl.directions:
            record = Timing(case.op, impl.name, impl.role, dtype_name, case.group, case.label, case.n, direction,
                            bytes=bytes_moved(case.op, direction, case.elements, ELEMENT_SIZE[dtype_name]))
            results.timings.append(record)
            if skip:
                record.note = skip
                continue
            first = None
            try:
                fn = prepare(impl, case.op, direction, inputs)
                key = (impl.name, case.op, direction)
                if direction != "forward+backward" and key not in self.seen_first:
                    self.seen_first.add(key)
                    first = FirstCall(impl.name, case.op, direction, dtype_name, case.label, _first_call_ms(fn))
                    results.first_calls.append(first)
                record.ms = self.timer(fn)
            except NotMeasured as reason:
                record.note = str(reason)
            except Exception as error:  # noqa: BLE001 - record it (out of memory, a failing kernel) and go on
                record.note = describe_error(error)
                self.note(f"{impl.name} {case.op} {dtype_name} {case.label} {direction}: {record.note}")
                _recover()
            fn = None
            if record.ms:
                record.gb_per_s = gb_per_s(record.bytes, record.ms)
                if copy_gb_per_s:
                    record.fraction_of_copy = record.gb_per_s / copy_gb_per_s
                if first is not None:
                    first.steady_ms = record.ms


def _recover() -> None:
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken context is reported by the next measurements
        pass


def copy_ms(timer: Callable) -> float:
    """Milliseconds of ``dst.copy_(src)`` over 1 GiB (bytes moved: 2 GiB, read + write)."""
    import torch

    return _copy_of(timer, (COPY_BYTES // 4,), torch.float32)[0]


def environment(backends: list[str], timing_method: str, liger_note: str) -> dict:
    import torch

    from ._registry import get_backend

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    env = {
        "gpu": f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "timing": timing_method,
        "liger": liger_note,
    }
    for name in backends:
        try:
            env[f"backend {name}"] = get_backend(name).version() or "not installed"
        except Exception as error:  # noqa: BLE001
            env[f"backend {name}"] = describe_error(error)
    return env


def choose_impls(args) -> tuple[list[str], list[Impl], str]:
    import multisoft

    from ._registry import get_backend

    if args.backends is None:
        backends = multisoft.available_backends()
    else:
        backends = []
        for name in args.backends:
            try:
                get_backend(name)
            except ValueError as error:
                print(f"multisoft bench: {error}", file=sys.stderr)
                continue
            backends.append(name)
    # the in-place cross-entropy timed beside the ordinary one, in the same case
    impls = [_backend_impl(name) for name in backends] + [_inplace_impl(name) for name in backends]
    liger_note = "not timed (--no-peers)"
    if not args.no_peers:
        impls.append(_torch_peer())
        liger, liger_note = liger_peer()
        if liger is not None:
            impls.append(liger)
    return backends, impls, liger_note


def run(args) -> Results:
    import torch

    started = time.perf_counter()
    torch.manual_seed(0)
    runner = Runner(args)
    backends, impls, liger_note = choose_impls(args)
    results = Results(environment(backends, runner.timing_method, liger_note), None)
    print(f"multisoft bench on {results.environment['gpu']}; backends: {', '.join(backends) or 'none'}; "
          f"liger: {liger_note}", file=sys.stderr)
    ms = copy_ms(runner.timer)
    results.copy_gb_per_s = gb_per_s(2 * COPY_BYTES, ms)
    results.timings.append(Timing("copy", "torch", "copy", "-", "copy", f"{COPY_BYTES >> 20} MiB", 0, "copy",
                                  ms=ms, bytes=2 * COPY_BYTES, gb_per_s=results.copy_gb_per_s,
                                  fraction_of_copy=1.0))
    plan = plan_cases(args.ops, args.quick)
    results.timings += same_bytes_copies(runner, plan, args.dtypes, results.copy_gb_per_s)
    memory_cases = plan.get("cross_entropy", [])
    memory_impls = [impl for impl in impls if "cross_entropy" in impl.ops]
    total = sum(len(cases) * len([i for i in impls if op in i.ops]) for op, cases in plan.items())
    total = total * len(args.dtypes) + len(memory_cases) * len(args.dtypes) * len(memory_impls)
    runner.progress = Progress(total + 1)
    try:
        for op, cases in plan.items():
            for dtype_name in args.dtypes:
                for case in cases:
                    _run_case(runner, impls, case, dtype_name, results)
        for dtype_name in args.dtypes:
            for case in memory_cases:
                _run_memory(runner, memory_impls, case, dtype_name, results)
        runner.progress.step("host overhead")
        results.overhead = host_overhead(runner, backends)
    finally:
        runner.progress.close()
    results.environment[COPY_AT_END] = f"{gb_per_s(2 * COPY_BYTES, copy_ms(runner.timer)):.0f} GB/s"
    results.environment["run time"] = f"{time.perf_counter() - started:.0f} s"
    return results


def _copy_of(timer: Callable, shape: tuple, dtype) -> tuple[float, int]:
    """(milliseconds, bytes read and written) of ``dst.copy_(src)`` for tensors of ``shape``."""
    import torch

    src = torch.empty(shape, dtype=dtype, device=DEVICE)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()


def same_bytes_copies(runner: Runner, plan: dict, dtypes: list[str], copy_gb_per_s: float) -> list[Timing]:
    """``dst.copy_(src)`` of one input of each dense headline shape, against the long copy: a short
    kernel's launch, ramp-up and tail cost it part of that bandwidth, whatever it computes."""
    import torch

    shapes = dict.fromkeys(case.shape for cases in plan.values() for case in cases
                           if "headline" in case.group and case.layout is None)
    records = []
    for rows, cols in shapes:
        for dtype_name in dtypes:
            record = Timing("copy", "torch", "copy", dtype_name, "headline", f"{rows}x{cols}", cols, "copy")
            try:
                record.ms, record.bytes = _copy_of(runner.timer, (rows, cols), getattr(torch, DTYPES[dtype_name]))
                record.gb_per_s = gb_per_s(record.bytes, record.ms)
                record.fraction_of_copy = record.gb_per_s / copy_gb_per_s
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: noted, the run goes on
                record.note = describe_error(error)
                _recover()
            records.append(record)
    return records


def _run_case(runner: Runner, impls: list[Impl], case: Case, dtype_name: str, results: Results) -> None:
    runnable = [impl for impl in impls if case.op in impl.ops]
    try:
        inputs = make_inputs(case, dtype_name)
    except Exception as error:  # noqa: BLE001 - e.g. out of memory: every impl gets the note
        note = describe_error(error)
        _recover()
        for impl in runnable:
            runner.progress.step(f"{case.op} {dtype_name} {case.label} {impl.name}")
            for direction in impl.directions:
                results.timings.append(Timing(case.op, impl.name, impl.role, dtype_name, case.group, case.label,
                                              case.n, direction, note=note))
        return
    for impl in runnable:
        runner.progress.step(f"{case.op} {dtype_name} {case.label} {impl.name}")
        runner.measure(impl, case, dtype_name, inputs, results.copy_gb_per_s, results)
    del inputs
    _recover()


def _run_memory(runner: Runner, impls: list[Impl], case: Case, dtype_name: str, results: Results) -> None:
    """Peak memory of one cross-entropy forward+backward per impl."""
    import torch

    try:
        inputs = make_inputs(case, dtype_name)
    except Exception as error:  # noqa: BLE001
        _recover()
        runner.note(f"memory {case.label} {dtype_name}: {describe_error(error)}")
        return
    logits_mib = inputs["x"].numel() * inputs["x"].element_size() / 2**20
    for impl in impls:
        runner.progress.step(f"memory {dtype_name} {case.label} {impl.name}")
        record = MemoryRecord(impl.name, dtype_name, case.label, None, logits_mib)
        results.memory.append(record)
        record.note = runner.skip_reason(impl, case.op, dtype_name)
        if record.note:
            continue
        try:
            f = impl.make(case.op, inputs)
            x = inputs["x"].detach().clone().requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = f(x)
            (grad,) = torch.autograd.grad(loss, x)
            torch.cuda.synchronize()
            record.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            del loss, grad, x
        except Exception as error:  # noqa: BLE001
            record.note = describe_error(error)
            _recover()
    del inputs
    _recover()


def host_overhead(runner: Runner, backends: list[str], calls: int = 2000) -> list[Overhead]:
    """Per-call wall time of multisoft.softmax vs the backend's kernel forward on a (4, 128) input."""
    import torch

    import multisoft

    from ._registry import get_backend

    x = torch.randn(4, 128, device=DEVICE)
    out = torch.empty_like(x)
    rows = []
    for name in backends:
        note = runner.skip_reason(_backend_impl(name), "softmax", "fp32")
        if note:
            rows.append(Overhead(name, None, None, note))
            continue
        try:
            kernel = get_backend(name).kernels("softmax")
            api = wall_us_per_call(lambda: multisoft.softmax(x, backend=name), calls)
            direct = wall_us_per_call(lambda: kernel.forward(x, out, False), calls)
            rows.append(Overhead(name, api, direct))
        except Exception as error:  # noqa: BLE001
            _recover()
            rows.append(Overhead(name, None, None, describe_error(error)))
    native = wall_us_per_call(lambda: torch.softmax(x, -1), calls)
    rows.append(Overhead(TORCH_PEER, native, native, "torch.softmax, for reference"))
    return rows


# -- reports


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, rows: list, extra: dict | None = None) -> Path:
    """Every dataclass field (plus the ``extra`` properties) of ``rows`` as CSV columns."""
    extra = extra or {}
    names = [field.name for field in dataclasses.fields(rows[0])] if rows else []
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(names + list(extra))
        for row in rows:
            writer.writerow([_cell(getattr(row, name)) for name in names]
                            + [_cell(getter(row)) for getter in extra.values()])
    return path


def write_reports(results: Results, out: Path, shortfalls: list[Shortfall] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_csv(out / "timings.csv", results.timings)]
    environment_path = out / ENVIRONMENT_FILE
    environment_path.write_text(json.dumps({"environment": results.environment,
                                            "copy_gb_per_s": results.copy_gb_per_s}, indent=1) + "\n")
    paths.append(environment_path)
    if results.memory:
        paths.append(write_csv(out / "memory.csv", results.memory))
    if results.first_calls:
        paths.append(write_csv(out / "first_calls.csv", results.first_calls))
    if results.overhead:
        paths.append(write_csv(out / "overhead.csv", results.overhead,
                               {"difference_us": lambda row: row.difference_us}))
    paths.append(write_markdown(results, out, shortfalls))
    return paths


def write_markdown(results: Results, out: Path, shortfalls: list[Shortfall] | None = None) -> Path:
    markdown = out / "results.md"
    markdown.write_text(markdown_report(results, shortfalls))
    return markdown


def _read_csv(path: Path, record: type) -> list:
    """The rows of a CSV written by write_csv as ``record`` dataclasses (columns it lacks are ignored)."""
    hints = get_type_hints(record)
    fields = [field.name for field in dataclasses.fields(record)]
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))

    def value(name, text):
        kind = hints[name]
        if text == "" and kind != str:
            return None
        return int(text) if kind is int else float(text) if kind in (float, float | None) else text

    return [record(**{name: value(name, row[name]) for name in fields if name in row}) for row in rows]


def read_results(out: Path) -> Results:
    """The Results that write_reports wrote to ``out``."""
    environment_path = out / ENVIRONMENT_FILE
    if not environment_path.exists():
        raise ValueError(f"{environment_path} not found: --report-only needs a folder written by a run that "
                         f"saves it")
    saved = json.loads(environment_path.read_text())
    results = Results(saved["environment"], saved["copy_gb_per_s"], _read_csv(out / "timings.csv", Timing))
    for name, record in (("memory", MemoryRecord), ("first_calls", FirstCall), ("overhead", Overhead)):
        if (out / f"{name}.csv").exists():
            setattr(results, name, _read_csv(out / f"{name}.csv", record))
    return results


def impl_order(timings: list[Timing]) -> list[str]:
    """Backends first, then peers, each in the order they were run."""
    backends = [t.impl for t in timings if t.role == "backend"]
    peers = [t.impl for t in timings if t.role == "peer"]
    return list(dict.fromkeys(backends + peers))


def _fraction_cell(record: Timing | None, best: float | None) -> str:
    if record is None or (record.ms is None and not record.note.startswith("error")):
        return "—"
    if record.ms is None:
        return "error"
    if record.fraction_of_copy is None:
        return f"{record.gb_per_s:.0f} GB/s"
    text = f"{record.fraction_of_copy:.2f}"
    return f"**{text}**" if best is not None and record.fraction_of_copy == best else text


def fraction_table(timings: list[Timing], direction: str) -> list[str]:
    """Markdown rows: one per (shape, dtype), one column per impl, cells the fraction of copy."""
    rows = [t for t in timings if t.direction == direction]
    if not rows:
        return []
    impls = impl_order(rows)
    keys = list(dict.fromkeys((t.shape, t.dtype) for t in rows))
    by_key = {(t.shape, t.dtype, t.impl): t for t in rows}
    lines = ["| shape | dtype | " + " | ".join(impls) + " |", "|---|---|" + "---:|" * len(impls)]
    for shape, dtype in keys:
        cells = [by_key.get((shape, dtype, impl)) for impl in impls]
        fractions = [c.fraction_of_copy for c in cells if c is not None and c.fraction_of_copy is not None]
        best = max(fractions) if len(fractions) > 1 else None
        lines.append(f"| {shape} | {dtype} | " + " | ".join(_fraction_cell(c, best) for c in cells) + " |")
    return lines


def _op_section(op: str, timings: list[Timing]) -> list[str]:
    lines = [f"## {op}", ""]
    main = [t for t in timings if t.group != "sweep"]
    dtypes = list(dict.fromkeys(t.dtype for t in timings))
    sweep = sorted((t for t in timings if "sweep" in t.group), key=lambda t: (dtypes.index(t.dtype), t.n))
    for direction in ("forward+backward", "forward", "backward"):
        table = fraction_table(main, direction)
        if table:
            lines += [f"**{direction}**", ""] + table + [""]
    if sweep:
        lines += [f"<details><summary>sweep over N (M·N = {SWEEP_ELEMENTS >> 20}M elements)</summary>", ""]
        for direction in ("forward+backward", "forward", "backward"):
            table = fraction_table(sweep, direction)
            if table:
                lines += [f"**{direction}**", ""] + table + [""]
        lines += ["</details>", ""]
    problems = _problems(timings)
    if problems:
        lines += ["Errors (`error`) and cells not timed (`—`):", ""] + problems + [""]
    return lines


def _problems(timings: list[Timing]) -> list[str]:
    """One line per (impl, note): the note, its first cell and how many more share it; errors first."""
    cells: dict[tuple, list[str]] = {}
    for t in timings:
        if t.note:
            cells.setdefault((t.impl, t.note), []).append(f"{t.dtype} {t.shape} {t.direction}")
    ordered = sorted(cells.items(), key=lambda item: not item[0][1].startswith("error"))
    return [f"- {impl}: {note} ({where[0]}{f' and {len(where) - 1} more' if len(where) > 1 else ''})"
            for (impl, note), where in ordered]


def target_of(impl: str) -> float | None:
    """The speed target of a backend, or of its variant ("numba inplace": numba's)."""
    return TARGETS.get(impl.split()[0], DEFAULT_TARGET)


def _shortfall_note(timing: Timing, target: float, copy_bound: float | None,
                    shortfalls: list[Shortfall] | None) -> str:
    """A below-target cell's note: the run's own (an error), a copy of its bytes that stays under the target
    too, and the first matching shortfall's reason (NO_REASON when shortfalls are given and none matches)."""
    notes = [timing.note]
    if copy_bound is not None and round(copy_bound, 2) < target:
        notes.append(f"a copy of its bytes reaches {copy_bound:.2f}")
    if shortfalls is not None and not timing.note:
        found = first_shortfall(shortfalls, timing)
        notes.append(found.why if found else NO_REASON)
    return "; ".join(note for note in notes if note)


def against_targets(timings: list[Timing]) -> dict[str, tuple[float, list[Timing], list[Timing]]]:
    """Per backend (or variant) with a target: (target, the cells held to it, those below it, rounded to two
    places as the tables show them)."""
    held = [t for t in timings if t.role == "backend" and target_of(t.impl) is not None
            and t.direction in TARGET_DIRECTIONS.get(t.op, ()) and ("headline" in t.group or t.group == "layout")]
    verdicts = {}
    for impl in dict.fromkeys(t.impl for t in held):
        cells = [t for t in held if t.impl == impl]
        target = target_of(impl)
        below = [t for t in cells if t.fraction_of_copy is None or round(t.fraction_of_copy, 2) < target]
        verdicts[impl] = target, cells, below
    return verdicts


def _targets_section(timings: list[Timing], shortfalls: list[Shortfall] | None = None) -> list[str]:
    """Per backend with a target: how many cells it is held to and falls below, then those cells, each with why
    (_shortfall_note)."""
    verdicts = against_targets(timings)
    if not verdicts:
        return []
    copies = {(t.shape, t.dtype, t.bytes): t.fraction_of_copy for t in timings if t.role == "copy"}
    why = SHORTFALL_REASONS if shortfalls is None else \
        f"the note of each cell below (the files it names are in benchmarks/results/tuning/; more: {SHORTFALL_REASONS})"
    lines = ["## against the targets", "",
             "Cells held to a backend's target: "
             + "; ".join(f"{op} {', '.join(directions)}" for op, directions in TARGET_DIRECTIONS.items())
             + ", on the headline shapes and the layouts (not the sweep). Below a target: the cell as the tables "
             f"round it is under it. Why each falls short, as measured: {why}.", "",
             "| backend | target | cells | below | below, by op and direction |", "|---|---:|---:|---:|---|"]
    for impl, (target, cells, below) in verdicts.items():
        counts = collections.Counter(f"{t.op} {t.direction}" for t in below)
        lines.append(f"| {impl} | {target:.2f} | {len(cells)} | {len(below)} | "
                     + ", ".join(f"{key} {count}" for key, count in counts.items()) + " |")
    lines.append("")
    for impl, (target, _, below) in verdicts.items():
        if not below:
            continue
        lines += [f"<details><summary>{impl}: the {len(below)} cells below {target:.2f}</summary>", "",
                  "| op | direction | shape | dtype | fraction of copy | note |", "|---|---|---|---|---:|---|"]
        for t in below:
            note = _shortfall_note(t, target, copies.get((t.shape, t.dtype, t.bytes)), shortfalls)
            lines.append(f"| {t.op} | {t.direction} | {t.shape} | {t.dtype} | {_number(t.fraction_of_copy, 2)} | "
                         f"{note} |")
        lines += ["", "</details>", ""]
    return lines


def _number(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown_report(results: Results, shortfalls: list[Shortfall] | None = None) -> str:
    env = dict(results.environment)
    at_end = env.pop(COPY_AT_END, None)
    copy = results.copy_gb_per_s
    lines = ["# multisoft benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += [f"- copy bandwidth (`dst.copy_(src)`, {COPY_BYTES >> 20} MiB, read + write): **{copy:.0f} GB/s**"
              + (f" ({at_end} at the end of the run)" if at_end else "") if copy else "- copy bandwidth: not measured",
              ""]
    lines += ["Each cell is the achieved bandwidth as a fraction of that copy bandwidth (best of a row in "
              "bold). Bytes counted: softmax, log_softmax and block-sparse (over Z·nnz·block² elements): "
              "forward 2, backward 3, forward+backward 5 × elements × element size; cross-entropy: 1, 2, 3 × "
              "M·V × element size. A fused implementation can pass 1.0 on forward+backward. "
              "Milliseconds and GB/s are in `timings.csv`; `—` = not timed (listed under each table).", ""]
    if env.get("timing", "").startswith(("triton.testing.do_bench", "torch.cuda.Event")):
        lines += ["These times include host overhead wherever the host launches a call more slowly than the GPU "
                  "runs it (small tensors, forward+backward through autograd); `--timer queued` times the GPU "
                  "work only.", ""]
    lines += _targets_section(results.timings, shortfalls)
    ops = list(dict.fromkeys(t.op for t in results.timings if t.role != "copy"))
    for op in ops:
        lines += _op_section(op, [t for t in results.timings if t.op == op])
    if results.memory:
        lines += ["## cross_entropy: peak memory of forward+backward", "",
                  "`torch.cuda.max_memory_allocated()` above what was allocated before the call (the logits "
                  "themselves not counted).", "",
                  "| shape | dtype | impl | peak (MiB) | × logits | note |", "|---|---|---|---:|---:|---|"]
        for m in results.memory:
            ratio = None if m.peak_mib is None else m.peak_mib / m.logits_mib
            lines.append(f"| {m.shape} | {m.dtype} | {m.impl} | {_number(m.peak_mib, 0)} | {_number(ratio, 2)} "
                         f"| {m.note} |")
        lines.append("")
    if results.first_calls:
        lines += ["## first call (compile) time", "",
                  "Wall time of the first call of each op in this process, synchronised; the on-disk caches of "
                  "Triton, CuPy and numba can make it shorter than a cold compile.", "",
                  "| impl | op | direction | dtype | shape | first call (ms) | steady (ms) |",
                  "|---|---|---|---|---|---:|---:|"]
        for f in results.first_calls:
            lines.append(f"| {f.impl} | {f.op} | {f.direction} | {f.dtype} | {f.shape} | {f.first_call_ms:.1f} | "
                         f"{_number(f.steady_ms, 3)} |")
        lines.append("")
    copies = [t for t in results.timings if t.role == "copy" and t.group == "headline"]
    if copies:
        lines += ["## copy of each headline shape's bytes", "",
                  "`dst.copy_(src)` of one input of each shape, as a fraction of the copy above: launch, ramp-up "
                  "and tail leave about this much to any kernel that reads and writes that many bytes.", "",
                  "| shape | dtype | MiB copied | fraction of copy | note |", "|---|---|---:|---:|---|"]
        for t in copies:
            mib = t.bytes / 2 / 2**20 if t.bytes else None
            lines.append(f"| {t.shape} | {t.dtype} | {_number(mib, 0)} | {_number(t.fraction_of_copy, 2)} | "
                         f"{t.note} |")
        lines.append("")
    if results.overhead:
        lines += ["## host overhead per call, softmax of a (4, 128) float32 tensor", "",
                  "Wall time per call over 2000 calls with one synchronize at the end.", "",
                  "| impl | `multisoft.softmax` (µs) | kernel `forward` (µs) | difference (µs) | note |",
                  "|---|---:|---:|---:|---|"]
        for o in results.overhead:
            lines.append(f"| {o.impl} | {_number(o.api_us)} | {_number(o.direct_us)} | {_number(o.difference_us)} "
                         f"| {o.note} |")
        lines.append("")
    return "\n".join(lines)
