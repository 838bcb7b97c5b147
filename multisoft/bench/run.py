"""One benchmark run: every case of the plan on every implementation (its kernel time and its eager wall time),
then peak memory, fused linear cross-entropy, vocabulary-parallel cross-entropy, a small Llama's training step and
per-token log-probabilities on logits and fused with the output layer (when asked for), the host time a call and
the environment, with a progress bar."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import host_time, impls, linear, linear_log_probs, log_probs, plan, timing, train_step, vocab_parallel
from .impls import Impl
from .progress import Progress
from .records import BYTES_COUNTED, COPY_AT_END, FirstCall, MemoryRecord, Results, Timing, describe_error

DEVICE = "cuda"  # the tests' dry run sets "cpu"


class Runner:
    """What one run shares: the device, the timers, the directions timed, the first calls seen, the kernel modules
    that failed."""

    def __init__(self, args):
        import torch

        self.device = torch.device(DEVICE)
        self.timer, self.timing_method = timing.make_timer(args.warmup, args.rep, args.timer)
        self.eager_timer, self.eager_method = timing.make_eager_timer(args.timer, args.eager_rep)
        self.directions = plan.HEADLINE_DIRECTIONS if args.headline else plan.DIRECTIONS
        self.seen_first: set = set()
        self.failed_modules: dict = {}
        self.progress: Progress | None = None

    def skip_reason(self, impl: Impl, op: str, dtype_name: str) -> str:
        """Why ``impl`` cannot run ``op`` in ``dtype_name`` here; "" when it can."""
        if impl.role != "backend":
            return ""
        import torch

        from .._registry import get_backend

        name = impl.name.split()[0]
        try:
            backend = get_backend(name)
            reason = backend.unavailable_reason(self.device, getattr(torch, plan.DTYPES[dtype_name]))
        except Exception as error:  # noqa: BLE001
            return describe_error(error)
        if reason:
            return f"unavailable: {reason}"
        if not backend.supports(plan.KERNEL_MODULE[op]):
            return f"{name} does not implement {plan.KERNEL_MODULE[op]}"
        key = (name, plan.KERNEL_MODULE[op])
        if key not in self.failed_modules:
            try:
                backend.kernels(plan.KERNEL_MODULE[op])
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

    def measure(self, impl: Impl, case: plan.Case, dtype_name: str, inputs: dict, results: Results) -> None:
        """Time each of ``impl``'s directions on ``case`` (of those this run times): a Timing each, with the kernel
        time and then the eager wall time of the same call (and a FirstCall for each first forward and backward of
        an op)."""
        skip = self.skip_reason(impl, case.op, dtype_name) or impls.lacking_options(impl, case.options)
        for direction in (d for d in impls.directions_of(impl, case.op) if d in self.directions):
            record = Timing(case.op, impl.name, impl.role, dtype_name, case.group, case.label, case.n, direction,
                            bytes=plan.bytes_moved(case.op, direction, case.elements, plan.ELEMENT_SIZE[dtype_name]))
            results.timings.append(record)
            if skip:
                record.note = skip
                continue
            first = None
            try:
                fn = impls.prepare(impl, case.op, direction, inputs)
                key = (impl.name, case.op, direction)
                if direction != "forward+backward" and key not in self.seen_first:
                    self.seen_first.add(key)
                    first = FirstCall(impl.name, case.op, direction, dtype_name, case.label, timing.first_call_ms(fn))
                    results.first_calls.append(first)
                record.ms = self.timer(fn)
                record.eager_ms = record.ms if self.eager_timer is None else self.eager_timer(fn)
            except Exception as error:  # noqa: BLE001 - record it (out of memory, a failing kernel) and go on
                record.note = describe_error(error)
                self.note(f"{impl.name} {case.op} {dtype_name} {case.label} {direction}: {record.note}")
                timing.recover()
            fn = None
            if record.ms:
                record.gb_per_s = plan.gb_per_s(record.bytes, record.ms)
                if results.copy_gb_per_s:
                    record.fraction_of_copy = record.gb_per_s / results.copy_gb_per_s
                if first is not None:
                    first.steady_ms = record.ms
            if record.eager_ms and results.copy_gb_per_s:
                record.eager_fraction = plan.gb_per_s(record.bytes, record.eager_ms) / results.copy_gb_per_s


def _copy_of(timer: Callable, shape: tuple, dtype) -> tuple[float, int]:
    """(milliseconds, bytes read and written) of ``dst.copy_(src)`` for tensors of ``shape``."""
    import torch

    src = torch.empty(shape, dtype=dtype, device=DEVICE)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()


def copy_ms(timer: Callable) -> float:
    """Milliseconds of ``dst.copy_(src)`` over COPY_BYTES (bytes moved: twice that, read + write)."""
    import torch

    return _copy_of(timer, (plan.COPY_BYTES // 4,), torch.float32)[0]


def source_commit() -> str | None:
    """The git commit of the multisoft source that runs, when it runs from a git checkout ("+ changes" when the
    checkout differs from it); None otherwise."""
    here = str(Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        changes = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0 or not commit.stdout.strip():
        return None
    return commit.stdout.strip() + (" + changes" if changes.stdout.strip() else "")


def environment(backends: list[str], runner: Runner, liger_note: str) -> dict:
    import torch

    from .._registry import get_backend

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    env = {
        "gpu": f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": source_commit() or "unknown (not run from a git checkout)",
        "timing": runner.timing_method,
        "eager timing": runner.eager_method,
        "host time": f"wall clock a call, mean of {host_time.HOST_CALLS} calls synchronised only at the ends",
        "liger": liger_note,
        BYTES_COUNTED: plan.bytes_counted(),
    }
    for name in backends:
        try:
            env[f"backend {name}"] = get_backend(name).version() or "not installed"
        except Exception as error:  # noqa: BLE001
            env[f"backend {name}"] = describe_error(error)
    return env


def selectable_only_by_name(name: str) -> bool:
    """Whether backend ``name`` sets AUTOMATIC = False (a float64 reference): such a backend is never timed."""
    from .._registry import get_backend

    try:
        return getattr(get_backend(name).module, "AUTOMATIC", True) is False
    except Exception:  # noqa: BLE001 - a backend that does not import is timed, and its cells say why it failed
        return False


def choose_impls(args) -> tuple[list[str], list[Impl], str]:
    """The backends to time (``args.backends``, else every one available here), less those selectable only by
    name; the implementations (each backend, its in-place cross-entropy, the peers); and Liger's note."""
    import multisoft

    from .._registry import get_backend

    backends = []
    for name in multisoft.available_backends() if args.backends is None else args.backends:
        try:
            get_backend(name)
        except ValueError as error:
            print(f"multisoft bench: {error}", file=sys.stderr)
            continue
        if selectable_only_by_name(name):
            if args.backends is not None:
                print(f"multisoft bench: backend {name!r} is not timed (AUTOMATIC = False: selectable only by "
                      f"name, a reference)", file=sys.stderr)
            continue
        backends.append(name)
    # the in-place cross-entropy timed beside the ordinary one, in the same case
    chosen = [impls.backend_impl(name) for name in backends] + [impls.inplace_impl(name) for name in backends]
    liger_note = "not timed (--no-peers)"
    if not args.no_peers:
        chosen.append(impls.torch_peer())
        liger, liger_note = impls.liger_peer()
        if liger is not None:
            chosen.append(liger)
    return backends, chosen, liger_note


def run(args) -> Results:
    import torch

    started = time.perf_counter()
    torch.manual_seed(0)
    runner = Runner(args)
    backends, chosen, liger_note = choose_impls(args)
    results = Results(environment(backends, runner, liger_note), None)
    print(f"multisoft bench on {results.environment['gpu']}; backends: {', '.join(backends) or 'none'}; "
          f"liger: {liger_note}", file=sys.stderr)
    ms = copy_ms(runner.timer)
    results.copy_gb_per_s = plan.gb_per_s(2 * plan.COPY_BYTES, ms)
    results.timings.append(Timing("copy", "torch", "copy", "-", "copy", f"{plan.COPY_BYTES >> 20} MiB", 0, "copy",
                                  ms=ms, bytes=2 * plan.COPY_BYTES, gb_per_s=results.copy_gb_per_s,
                                  fraction_of_copy=1.0))
    cases = plan.plan_cases(args.ops, args.quick, args.headline)
    results.timings += same_bytes_copies(runner, cases, args.dtypes, results.copy_gb_per_s)
    linear_shapes = linear.cases(args.quick) if linear.OP in args.ops and not args.headline else []
    linear_impls = []
    if linear_shapes:
        linear_impls, linear_notes = linear.choose_impls(backends, not args.no_peers)
        results.environment.update(linear_notes)
        results.environment["linear_cross_entropy timing"] = linear.TIMING
    split_shapes = vocab_parallel.cases(args.quick) if vocab_parallel.OP in args.ops and not args.headline else []
    if split_shapes:
        results.environment.update(vocab_parallel.environment_notes())
    step_variants = train_step.variants(backends) if train_step.OP in args.ops and not args.headline else []
    step_config, step_counts = train_step.config(args.quick), train_step.counts(args.quick)
    if step_variants:
        results.environment.update(train_step.environment_notes(step_config, step_counts))
    lp_cells = log_probs.cases(args.quick, args.dtypes) if log_probs.OP in args.ops and not args.headline else []
    lp_impls = log_probs.choose_impls(backends, not args.no_peers) if lp_cells else []
    llp_cells = (linear_log_probs.cases(args.quick, args.dtypes)
                 if linear_log_probs.OP in args.ops and not args.headline else [])
    llp_impls = []
    if llp_cells:
        llp_impls, llp_notes = linear_log_probs.choose_impls(backends, not args.no_peers)
        results.environment.update(llp_notes)
        results.environment["linear_log_probs timing"] = linear_log_probs.TIMING
    for op, asked in ((log_probs.OP, lp_cells), (linear_log_probs.OP, llp_cells)):
        if op in args.ops and not args.headline and not asked:
            print(f"multisoft bench: {op} has no case in --dtypes {','.join(args.dtypes)} (its cases: "
                  f"{_cells_text(op, args.quick)})", file=sys.stderr)
    memory_cases = [] if args.headline else cases.get("cross_entropy", [])
    memory_impls = [impl for impl in chosen if "cross_entropy" in impl.ops]
    total = sum(len(case_dtypes(case, args.dtypes)) * len([i for i in chosen if op in i.ops])
                for op, op_cases in cases.items() for case in op_cases)
    total += sum(len(case_dtypes(case, args.dtypes)) for case in memory_cases) * len(memory_impls)
    total += len(linear_shapes) * len(args.dtypes) * (1 + len(linear_impls))
    total += len(backends) if split_shapes else 0  # one step per backend: its ranks run all its cases
    total += len(step_variants)
    total += len(lp_cells) * (1 + len(lp_impls)) + len(llp_cells) * (1 + len(llp_impls))
    host_timed = any(op in plan.OPS for op in args.ops)  # the host time a call of softmax and cross-entropy
    runner.progress = Progress(total + host_timed)
    try:
        for op_cases in cases.values():
            for dtype_name in args.dtypes:
                for case in op_cases:
                    if dtype_name in case_dtypes(case, args.dtypes):
                        _run_case(runner, chosen, case, dtype_name, results)
        for dtype_name in args.dtypes:
            for case in memory_cases:
                if dtype_name in case_dtypes(case, args.dtypes):
                    _run_memory(runner, memory_impls, case, dtype_name, results)
        results.linear = linear.run_cases(runner, linear_impls, linear_shapes, args.dtypes, timing.long_call_ms)
        results.vocab_parallel = vocab_parallel.run_cases(runner, backends, split_shapes, args.dtypes)
        results.train_step = train_step.run_cases(runner, step_variants, step_config, step_counts)
        results.log_probs = log_probs.run_cases(runner, lp_impls, lp_cells, results.copy_gb_per_s, runner.timer,
                                                runner.eager_timer)
        results.linear_log_probs = linear_log_probs.run_cases(runner, llp_impls, llp_cells, timing.long_call_ms)
        if host_timed:
            runner.progress.step("host time a call")
            results.host_times = host_time.measure_host_times(runner, chosen)
    finally:
        runner.progress.close()
    results.environment[COPY_AT_END] = f"{plan.gb_per_s(2 * plan.COPY_BYTES, copy_ms(runner.timer)):.0f} GB/s"
    results.environment["run time"] = f"{time.perf_counter() - started:.0f} s"
    return results


def _cells_text(op: str, quick: bool) -> str:
    """The cells of ``op`` (log_probs or linear_log_probs), as "8192x151936 bf16, 8192x32000 fp32"."""
    module = log_probs if op == log_probs.OP else linear_log_probs
    return ", ".join(f"{module.shape_label(shape)} {dtype}"
                     for shape, dtype in (module.QUICK_CELLS if quick else module.CELLS))


def case_dtypes(case: plan.Case, dtypes: list[str]) -> list[str]:
    """The dtypes of ``dtypes`` that ``case`` is timed in (a headline cell: its own)."""
    return [d for d in dtypes if not case.dtypes or d in case.dtypes]


def same_bytes_copies(runner: Runner, cases: dict, dtypes: list[str], copy_gb_per_s: float) -> list[Timing]:
    """``dst.copy_(src)`` of one input of each dense headline shape, against the long copy: a short
    kernel's launch, ramp-up and tail cost it part of that bandwidth, whatever it computes."""
    import torch

    shapes = dict.fromkeys((case.shape, dtype_name) for op_cases in cases.values() for case in op_cases
                           if "headline" in case.group and case.layout is None
                           for dtype_name in case_dtypes(case, dtypes))
    records = []
    for (rows, cols), dtype_name in shapes:
        record = Timing("copy", "torch", "copy", dtype_name, "headline", f"{rows}x{cols}", cols, "copy")
        try:
            record.ms, record.bytes = _copy_of(runner.timer, (rows, cols),
                                               getattr(torch, plan.DTYPES[dtype_name]))
            record.gb_per_s = plan.gb_per_s(record.bytes, record.ms)
            record.fraction_of_copy = record.gb_per_s / copy_gb_per_s
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: noted, the run goes on
            record.note = describe_error(error)
            timing.recover()
        records.append(record)
    return records


def _run_case(runner: Runner, chosen: list[Impl], case: plan.Case, dtype_name: str, results: Results) -> None:
    runnable = [impl for impl in chosen if case.op in impl.ops]
    try:
        inputs = impls.make_inputs(case, dtype_name, runner.device)
    except Exception as error:  # noqa: BLE001 - e.g. out of memory: every impl gets the note
        note = describe_error(error)
        timing.recover()
        for impl in runnable:
            runner.progress.step(f"{case.op} {dtype_name} {case.label} {impl.name}")
            for direction in (d for d in impls.directions_of(impl, case.op) if d in runner.directions):
                results.timings.append(Timing(case.op, impl.name, impl.role, dtype_name, case.group, case.label,
                                              case.n, direction, note=note))
        return
    for impl in runnable:
        runner.progress.step(f"{case.op} {dtype_name} {case.label} {impl.name}")
        runner.measure(impl, case, dtype_name, inputs, results)
    del inputs
    timing.recover()


def _run_memory(runner: Runner, chosen: list[Impl], case: plan.Case, dtype_name: str, results: Results) -> None:
    """Peak memory of one cross-entropy forward+backward per impl."""
    import torch

    try:
        inputs = impls.make_inputs(case, dtype_name, runner.device)
    except Exception as error:  # noqa: BLE001
        timing.recover()
        runner.note(f"memory {case.label} {dtype_name}: {describe_error(error)}")
        return
    logits_mib = inputs["x"].numel() * inputs["x"].element_size() / 2**20
    for impl in chosen:
        runner.progress.step(f"memory {dtype_name} {case.label} {impl.name}")
        record = MemoryRecord(impl.name, dtype_name, case.label, None, logits_mib)
        results.memory.append(record)
        record.note = runner.skip_reason(impl, case.op, dtype_name) or impls.lacking_options(impl, case.options)
        if record.note:
            continue
        try:
            f = impl.make(case.op, inputs)
            x = inputs["x"].detach().clone().requires_grad_(True)
            logits = impls.graph_input(impl, case.op, x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = f(logits)
            (grad,) = torch.autograd.grad(loss, x)
            torch.cuda.synchronize()
            record.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            del loss, grad, x, logits
        except Exception as error:  # noqa: BLE001
            record.note = describe_error(error)
            timing.recover()
    del inputs
    timing.recover()
