"""Whether the full run's in-place cross-entropy cells read low because of where the run times them.

Until f4865f7 `python -m multisoft bench` timed the ordinary cross-entropy forward+backward in `_run_case` and the
in-place one (inplace_backward=True) in `_run_memory`, right after the peak-memory calls of every backend. Timed
alone the two read the same (ce_inplace.py), in the full run the in-place one 0.01-0.09 lower at bf16 8192x32000.
This times, in one process and one case, the in-place call beside the ordinary one (as `_run_case` does now), then
as `_run_memory` did, after every backend's memory call, then the same without the torch backend's memory call (its
float64 reference fills the allocator's cache with large blocks), and after emptying that cache.

    python3 benchmarks/tune/ce_inplace_context.py --backends triton,cupy,numba,torch --shape 8192x32000 --dtype bf16
"""
import argparse
import sys
import types

from multisoft import bench

DIRECTION = "forward+backward"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton,cupy,numba,torch")
    parser.add_argument("--shape", default="8192x32000")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rounds", type=int, default=2, help="times to run the whole sequence")
    args = parser.parse_args(argv)
    runner = bench.Runner(types.SimpleNamespace(warmup=5.0, rep=25.0, timer="queued"))
    runner.progress = bench.Progress(10_000)
    results = bench.Results({}, None)
    results.copy_gb_per_s = bench.gb_per_s(2 * bench.COPY_BYTES, bench.copy_ms(runner.timer))
    print(f"copy bandwidth: {results.copy_gb_per_s:.0f} GB/s", flush=True)
    rows, cols = map(int, args.shape.split("x"))
    case = bench.dense_cases("cross_entropy", [(rows, cols)], [])[0]
    names = args.backends.split(",")
    plain = [bench._backend_impl(name) for name in names]
    inplace = [bench._inplace_impl(name) for name in names]
    without_torch = [impl for impl in plain if impl.name != "torch"]

    def after_memory(backends):
        """As the benchmark did before f4865f7: each impl's memory call, then each in-place one timed."""
        bench._run_memory(runner, backends + inplace, case, args.dtype, results)
        inputs = bench.make_inputs(case, args.dtype)
        for impl in inplace:
            runner.measure(impl, case, args.dtype, inputs, results.copy_gb_per_s, results)
        del inputs
    steps = (
        ("beside the ordinary call", lambda: bench._run_case(runner, plain + inplace, case, args.dtype, results)),
        ("after every backend's memory call", lambda: after_memory(plain)),
        ("after the memory calls but torch's", lambda: after_memory(without_torch)),
        ("the same, the cache emptied first", lambda: (bench._recover(), after_memory(without_torch))),
    )
    for round_ in range(args.rounds):
        for label, step in steps:
            done = len(results.timings)
            step()
            cells = [t for t in results.timings[done:] if t.direction == DIRECTION and t.fraction_of_copy]
            line = "  ".join(f"{t.impl} {t.fraction_of_copy:.3f}" for t in cells)
            print(f"round {round_ + 1} {args.dtype} {args.shape} {label:>36}: {line}", flush=True)
    runner.progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
