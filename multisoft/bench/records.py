"""What a run records (timings, peak memory, first calls, host time a call, its environment), the reasons given
for cells below their target, and the CSV and JSON files they are written to and read back from."""

from __future__ import annotations

import csv
import dataclasses
import fnmatch
import json
from pathlib import Path
from typing import get_type_hints

ENVIRONMENT_FILE = "environment.json"
HOST_TIME_FILE = "host_time.csv"
LINEAR_FILE = "linear_cross_entropy.csv"
VOCAB_PARALLEL_FILE = "vocab_parallel.csv"
TRAIN_STEP_FILE = "train_step.csv"
LOG_PROBS_FILE = "log_probs.csv"
LINEAR_LOG_PROBS_FILE = "linear_log_probs.csv"
COPY_AT_END = "copy bandwidth at the end"  # an environment entry: the long copy measured again after the run
BYTES_COUNTED = "bytes counted"  # an environment entry: how the run counted each op's bytes (plan.bytes_counted)
LIGER_LOG_PROBS = "liger fused linear log-probs"  # an environment entry: the Liger-Kernel op linear_log_probs times


@dataclasses.dataclass
class Timing:
    op: str
    impl: str
    role: str  # "backend", "peer" or "copy"
    dtype: str
    group: str  # "headline", "sweep", "headline,sweep", "layout" or "options" (cross-entropy with options)
    shape: str
    n: int  # row length, for the sweep plots (0 for block-sparse)
    direction: str
    ms: float | None = None  # kernel time: the GPU's work, host time hidden (with --timer queued)
    bytes: int = 0
    gb_per_s: float | None = None
    fraction_of_copy: float | None = None
    note: str = ""
    eager_ms: float | None = None  # eager wall time: do_bench, host time included
    eager_fraction: float | None = None  # of the copy bandwidth, at eager_ms


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
class HostTime:
    """Wall-clock microseconds a call of one op and direction on a tiny tensor, where the host, not the GPU, sets
    the pace; ``kernel_us``: a backend's softmax forward kernel called directly, without multisoft's front."""

    impl: str
    role: str  # "backend" or "peer"
    op: str
    dtype: str
    shape: str
    direction: str
    us: float | None
    kernel_us: float | None = None
    note: str = ""

    @property
    def front_us(self) -> float | None:
        """What multisoft's front (checks, allocation, dispatch) adds to the kernel's own call."""
        if self.us is None or self.kernel_us is None:
            return None
        return self.us - self.kernel_us


@dataclasses.dataclass
class LinearRecord:
    """One implementation's forward+backward of a mean fused linear cross-entropy (M x H hidden states, V x H
    weight) into the gradients of both: its time, its peak memory beyond the inputs (None off a GPU) and its
    error against a float64 reference, each divided by the reference's largest absolute value."""

    impl: str
    role: str  # "floor" (the three matrix products alone), "backend" or "peer"
    dtype: str
    shape: str  # "MxHxV"
    ms: float | None = None
    of_products: float | None = None  # ms / the products' ms of the same case
    extra_gib: float | None = None  # peak memory beyond what was allocated before the step, gradients included
    gradients_gib: float = 0.0  # the two gradients' bytes
    logits_gib: float = 0.0  # M·V × element size
    loss_error: float | None = None
    grad_input_error: float | None = None
    grad_weight_error: float | None = None
    note: str = ""

    @property
    def beyond_gradients_gib(self) -> float | None:
        return None if self.extra_gib is None else self.extra_gib - self.gradients_gib

    @property
    def of_logits(self) -> float | None:
        """The memory beyond the gradients as a fraction of the logits' size."""
        beyond = self.beyond_gradients_gib
        return None if beyond is None or not self.logits_gib else beyond / self.logits_gib


@dataclasses.dataclass
class LogProbsRecord:
    """One implementation's per-token log-probabilities and entropy on (M, V) logits (``--ops log_probs``): the
    times of the RL objective's forward+backward (kernel time and eager wall time), of its forward alone and of its
    forward+backward without the entropy; each time's bandwidth as a fraction of the run's copy bandwidth at the
    op's floor (forward: the logits read once; forward+backward: three passes over them); its peak memory beyond
    the inputs (None off a GPU); its errors against float64, each the largest difference over the reference's
    largest absolute value. The row of role "copy" is ``dst.copy_(src)`` of the logits (its bytes: read + write)."""

    impl: str
    role: str  # "backend", "peer" or "copy"
    dtype: str
    shape: str  # "MxV"
    ms: float | None = None  # forward+backward, kernel time (the run's timer)
    eager_ms: float | None = None  # forward+backward, eager wall time (host included)
    forward_ms: float | None = None
    forward_eager_ms: float | None = None
    no_entropy_ms: float | None = None  # forward+backward of the log-probabilities alone (return_entropy=False)
    no_entropy_eager_ms: float | None = None
    pass_bytes: int = 0  # one pass over the logits: M·V × element size
    fraction_of_copy: float | None = None  # forward+backward at 3 × pass_bytes (the copy row: its own bytes)
    eager_fraction: float | None = None
    forward_fraction: float | None = None  # forward at 1 × pass_bytes
    forward_eager_fraction: float | None = None
    extra_gib: float | None = None  # peak memory beyond what was allocated before the step, the gradient included
    log_probs_error: float | None = None
    entropy_error: float | None = None
    grad_error: float | None = None
    note: str = ""

    @property
    def logits_gib(self) -> float:
        return self.pass_bytes / 2**30

    @property
    def beyond_gradient_gib(self) -> float | None:
        """The peak memory beyond the inputs less the logits' gradient (as large as the logits)."""
        return None if self.extra_gib is None else self.extra_gib - self.logits_gib

    @property
    def entropy_cost(self) -> float | None:
        """What the entropy adds to forward+backward, kernel time: ms / no_entropy_ms - 1."""
        return None if self.ms is None or not self.no_entropy_ms else self.ms / self.no_entropy_ms - 1

    @property
    def eager_entropy_cost(self) -> float | None:
        """The same of the eager times."""
        if self.eager_ms is None or not self.no_entropy_eager_ms:
            return None
        return self.eager_ms / self.no_entropy_eager_ms - 1


@dataclasses.dataclass
class LinearLogProbsRecord:
    """One implementation's forward+backward of per-token log-probabilities and entropy of ``x @ w.T`` (M x H hidden
    states, V x H weight, no bias) into the gradients of both (``--ops linear_log_probs``): its time, its peak
    memory beyond the inputs (None off a GPU) and its errors against float64, each the largest difference over the
    reference's largest absolute value. The fields that linear_report.target_misses reads are LinearRecord's."""

    impl: str
    role: str  # "floor" (the four matrix products alone), "backend" or "peer"
    dtype: str
    shape: str  # "MxHxV"
    ms: float | None = None
    of_products: float | None = None  # ms / the products' ms of the same case
    extra_gib: float | None = None  # peak memory beyond what was allocated before the step, gradients included
    gradients_gib: float = 0.0  # the two gradients' bytes
    logits_gib: float = 0.0  # M·V × element size
    log_probs_error: float | None = None
    entropy_error: float | None = None
    grad_input_error: float | None = None
    grad_weight_error: float | None = None
    note: str = ""

    @property
    def beyond_gradients_gib(self) -> float | None:
        return None if self.extra_gib is None else self.extra_gib - self.gradients_gib

    @property
    def of_logits(self) -> float | None:
        """The memory beyond the gradients as a fraction of the logits' size."""
        beyond = self.beyond_gradients_gib
        return None if beyond is None or not self.logits_gib else beyond / self.logits_gib


@dataclasses.dataclass
class VocabParallelRecord:
    """Vocabulary-parallel cross-entropy of one backend, dtype and shape: a mean loss's forward+backward split over
    ``ranks`` GPUs (each rank its V/ranks columns, ``process_group=``) against the unsplit call on one GPU, and the
    all-gather of the split call alone; the errors are the split call's against a float64 reference (the loss's
    relative error; the gradient's largest difference over its largest value, the worst rank's)."""

    impl: str
    dtype: str
    shape: str  # "MxV"
    ranks: int
    unsplit_ms: float | None = None  # rank 0 alone, all V columns
    split_ms: float | None = None  # the slowest rank's
    rank_ms: str = ""  # each rank's split ms, in rank order, space-separated
    collective_ms: float | None = None  # the all-gather of (4, M) float32 alone, the slowest rank's
    loss: float | None = None  # the split call's loss
    unsplit_loss: float | None = None
    loss_error: float | None = None
    grad_error: float | None = None
    note: str = ""

    @property
    def of_unsplit(self) -> float | None:
        """The split call's time as a fraction of the unsplit call's."""
        if self.split_ms is None or not self.unsplit_ms:
            return None
        return self.split_ms / self.unsplit_ms

    @property
    def collective_share(self) -> float | None:
        """The collective's time as a fraction of the split call's."""
        if self.collective_ms is None or not self.split_ms:
            return None
        return self.collective_ms / self.split_ms


@dataclasses.dataclass
class TrainStepRecord:
    """One variant of a small Llama's training step (``train_step``): its mode (eager or compiled), its loss and
    multisoft backend, the tokens it trains a second, its peak memory, its first step's wall time and its loss after
    the steps timed, next to the torch loss's of the same mode."""

    mode: str  # "eager", "compiled" or "reduce-overhead" (the torch.compile mode of the forward and loss)
    loss: str  # "torch", "multisoft" or "multisoft-fused"
    backend: str  # the multisoft backend; "" for the torch loss
    model: str  # the model and batch (train_step.ModelConfig.label)
    tokens_per_s: float | None = None
    of_torch: float | None = None  # tokens_per_s / the torch loss's of the same mode
    peak_gib: float | None = None  # torch.cuda.max_memory_allocated() during one step (None off a GPU)
    first_step_s: float | None = None  # the first step's wall time, compiling included
    final_loss: float | None = None  # the loss of the last step
    loss_vs_torch: float | None = None  # |final_loss - the torch loss's| / |the torch loss's|, same mode
    note: str = ""


@dataclasses.dataclass
class Results:
    environment: dict
    copy_gb_per_s: float | None
    timings: list[Timing] = dataclasses.field(default_factory=list)
    memory: list[MemoryRecord] = dataclasses.field(default_factory=list)
    first_calls: list[FirstCall] = dataclasses.field(default_factory=list)
    host_times: list[HostTime] = dataclasses.field(default_factory=list)
    linear: list[LinearRecord] = dataclasses.field(default_factory=list)
    vocab_parallel: list[VocabParallelRecord] = dataclasses.field(default_factory=list)
    train_step: list[TrainStepRecord] = dataclasses.field(default_factory=list)
    log_probs: list[LogProbsRecord] = dataclasses.field(default_factory=list)
    linear_log_probs: list[LinearLogProbsRecord] = dataclasses.field(default_factory=list)


def describe_error(error: BaseException) -> str:
    """The note a cell gets when its call raised: "error: " and the exception's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return "error: " + text[:240]


# -- why cells fall short of their target


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


def load_shortfalls(path: Path) -> list[Shortfall]:
    """The rows of a shortfalls CSV (SHORTFALL_COLUMNS; lines starting with # are comments)."""
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


# -- files


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


def write_records(results: Results, out: Path) -> list[Path]:
    """timings.csv, environment.json and, where there are such records, memory.csv, first_calls.csv,
    host_time.csv, linear_cross_entropy.csv, vocab_parallel.csv, train_step.csv, log_probs.csv and
    linear_log_probs.csv in ``out``; the paths written."""
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
    if results.host_times:
        paths.append(write_csv(out / HOST_TIME_FILE, results.host_times, {"front_us": lambda row: row.front_us}))
    if results.linear:
        paths.append(write_csv(out / LINEAR_FILE, results.linear,
                               {"beyond_gradients_gib": lambda row: row.beyond_gradients_gib,
                                "of_logits": lambda row: row.of_logits}))
    if results.vocab_parallel:
        paths.append(write_csv(out / VOCAB_PARALLEL_FILE, results.vocab_parallel,
                               {"of_unsplit": lambda row: row.of_unsplit,
                                "collective_share": lambda row: row.collective_share}))
    if results.train_step:
        paths.append(write_csv(out / TRAIN_STEP_FILE, results.train_step))
    if results.log_probs:
        paths.append(write_csv(out / LOG_PROBS_FILE, results.log_probs,
                               {"beyond_gradient_gib": lambda row: row.beyond_gradient_gib,
                                "entropy_cost": lambda row: row.entropy_cost,
                                "eager_entropy_cost": lambda row: row.eager_entropy_cost}))
    if results.linear_log_probs:
        paths.append(write_csv(out / LINEAR_LOG_PROBS_FILE, results.linear_log_probs,
                               {"beyond_gradients_gib": lambda row: row.beyond_gradients_gib,
                                "of_logits": lambda row: row.of_logits}))
    return paths


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
    """The Results that write_records wrote to ``out``."""
    environment_path = out / ENVIRONMENT_FILE
    if not environment_path.exists():
        raise ValueError(f"{environment_path} not found: --report-only needs a folder written by a run that "
                         f"saves it")
    saved = json.loads(environment_path.read_text())
    results = Results(saved["environment"], saved["copy_gb_per_s"], _read_csv(out / "timings.csv", Timing))
    for name, file, record in (("memory", "memory.csv", MemoryRecord), ("first_calls", "first_calls.csv", FirstCall),
                               ("host_times", HOST_TIME_FILE, HostTime), ("linear", LINEAR_FILE, LinearRecord),
                               ("vocab_parallel", VOCAB_PARALLEL_FILE, VocabParallelRecord),
                               ("train_step", TRAIN_STEP_FILE, TrainStepRecord),
                               ("log_probs", LOG_PROBS_FILE, LogProbsRecord),
                               ("linear_log_probs", LINEAR_LOG_PROBS_FILE, LinearLogProbsRecord)):
        if (out / file).exists():
            setattr(results, name, _read_csv(out / file, record))
    return results
