"""Time one backend's kernels under several settings of its tuning constants, in one process.

Each ``--variant NAME:STATEMENTS`` runs STATEMENTS (Python, ``;``-separated, with
the backend's kernel modules importable by name) before its measurements, then
times the chosen cases exactly as ``python -m multisoft bench`` does (queued
CUDA events, L2 cleared, fraction of the copy bandwidth measured in the same
run). The statements of a variant are undone before the next one, and the kernel
modules' functools caches (their kernel factories) emptied before each, so every
variant starts from the module defaults and builds its kernels under its own settings.

    python3 benchmarks/tune/tune.py --backend triton --ops softmax --dtypes fp32,bf16 \
        --cases 1024x131072,512x262144 --directions forward \
        --variant base: \
        --variant 'chunk8k:import multisoft_triton.softmax as s; s.SPLIT_CONFIGS = ((8192, 8),)'

Results are printed, one line per measurement, and appended to ``--csv`` if given.
"""
import argparse
import csv
import importlib
import sys

from multisoft import bench


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ops", default="softmax")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--cases", default="", help="comma-separated case labels or label prefixes (default: headline)")
    parser.add_argument("--directions", default="forward,backward")
    parser.add_argument("--variant", action="append", default=[], help="NAME:STATEMENTS (repeatable)")
    parser.add_argument("--inplace", action="store_true", help="cross_entropy with inplace_backward=True")
    parser.add_argument("--csv", default="")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rep", type=float, default=25.0)
    return parser.parse_args(argv)


def chosen_cases(op, wanted):
    cases = bench.plan_cases([op], quick=False)[op]
    if not wanted:
        return [case for case in cases if "headline" in case.group or case.group in ("layout",)]
    return [case for case in cases if any(case.label.startswith(w) for w in wanted)]


class Undo:
    """Records module attributes that a variant's statements assign, to restore them afterwards."""

    def __init__(self, modules):
        self.saved = {name: dict(vars(importlib.import_module(name))) for name in modules}

    def added(self):
        """`module.NAME` of each upper-case name (a setting) that exists now but did not when recorded: a
        variant setting a constant the backend does not have (misspelt or renamed) would otherwise time the
        defaults."""
        return [f"{name}.{key}" for name in self.saved for key in vars(sys.modules[name])
                if key.isupper() and key not in self.saved[name]]

    def clear_caches(self):
        """Empty the modules' functools caches (the kernel factories): a kernel built under one variant's settings
        must not serve the next."""
        for name in self.saved:
            for value in list(vars(sys.modules[name]).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()

    def restore(self):
        for name, attrs in self.saved.items():
            module = sys.modules[name]
            for key in [key for key in vars(module) if key.isupper() and key not in attrs]:
                delattr(module, key)
            for key, value in attrs.items():
                if getattr(module, key, None) is not value:
                    setattr(module, key, value)


def main(argv=None):
    args = parse_args(argv)
    import multisoft  # noqa: F401 - registers the backends

    backend = multisoft._registry.get_backend(args.backend)
    modules = []
    for op_module in ("softmax", "cross_entropy", "blocksparse"):
        module = backend.kernels(op_module)
        modules.append(module.__name__)
    package = modules[0].rsplit(".", 1)[0]
    modules += [name for name in sys.modules if name.startswith(package + ".") and name not in modules]
    undo = Undo(modules)
    timer = lambda fn: bench.queued_bench(fn, args.warmup, args.rep)  # noqa: E731
    copy = bench.gb_per_s(2 * bench.COPY_BYTES, bench.copy_ms(timer))
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    impl = bench._inplace_impl(args.backend) if args.inplace else bench._backend_impl(args.backend)
    variants = [v.split(":", 1) for v in (args.variant or ["base:"])]
    rows = []
    for op in args.ops.split(","):
        for case in chosen_cases(op, [w for w in args.cases.split(",") if w]):
            for dtype in args.dtypes.split(","):
                inputs = bench.make_inputs(case, dtype)
                for name, statements in variants:
                    undo.clear_caches()
                    exec(statements, {})  # noqa: S102 - a developer's own tuning statements
                    unknown = undo.added()
                    if unknown:
                        raise SystemExit(f"variant {name!r} sets what its module does not have: "
                                         f"{', '.join(unknown)}")
                    for direction in args.directions.split(","):
                        nbytes = bench.bytes_moved(op, direction, case.elements, bench.ELEMENT_SIZE[dtype])
                        try:
                            ms = timer(bench.prepare(impl, op, direction, inputs))
                            note = ""
                        except Exception as error:  # noqa: BLE001 - record and go on
                            ms, note = float("nan"), bench.describe_error(error)
                            bench._recover()
                        fraction = bench.gb_per_s(nbytes, ms) / copy
                        rows.append(dict(variant=name, op=op, dtype=dtype, case=case.label, direction=direction,
                                         ms=f"{ms:.4f}", fraction=f"{fraction:.3f}", note=note))
                        print(f"{name:>14} {op:>12} {dtype} {case.label:>20} {direction:>16} "
                              f"{ms:8.4f} ms  {fraction:5.3f} {note}", flush=True)
                    undo.restore()
                del inputs
    if args.csv:
        with open(args.csv, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            if handle.tell() == 0:
                writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
