"""The command line of ``multisoft bench``: its options, and what a run or a report-only call writes."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from . import plan, timing
from .records import ENVIRONMENT_FILE, Results, describe_error, load_shortfalls, read_results
from .report import write_markdown, write_reports

DEFAULT_OUT = "multisoft-bench"  # in the current directory
NO_GPU_MESSAGE = "multisoft bench: no CUDA device found; the benchmark needs one (nothing was run)."


def parse_args(argv: list[str], prog: str = "python -m multisoft bench") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time every op on every backend (and torch / Liger-Kernel as peers) against the copy "
                    "bandwidth; write CSV, Markdown and PNG plots. Needs a CUDA GPU.")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--ops", help=f"comma-separated ops (default: all of {', '.join(plan.OPS)}; also "
                                      f"{', '.join(plan.EXTRA_OPS)} (aliases lce, vp, step, lp, llp), timed only "
                                      "when named; train_step: a small Llama's training step, fp32 whatever "
                                      "--dtypes; log_probs and linear_log_probs: each case in its own dtype, of "
                                      "those --dtypes names)")
    parser.add_argument("--backends", help="comma-separated backends (default: all that can run here, but those "
                                           "selectable only by name)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated of fp32, bf16, fp16 "
                                                              "(default: %(default)s)")
    parser.add_argument("--fp16", action="store_true", help="also time float16")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a few shapes only: a fast smoke run")
    size.add_argument("--headline", action="store_true",
                      help="the headline cells only (softmax fp32 32768x1024 and bf16 16384x4096, cross_entropy "
                           "bf16 and fp32 8192x32000; forward and forward+backward), and the host time a call")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--no-peers", action="store_true", help="do not time torch's, Liger-Kernel's or Cut "
                                                                "Cross-Entropy's ops")
    parser.add_argument("--timer", choices=("do_bench", "queued"), default="queued",
                        help="how the kernel time is taken: queued: CUDA events with the GPU held busy while the host "
                             "queues the calls, so host time is not timed; do_bench: triton.testing.do_bench, host "
                             "time included, which is then the eager time too (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=5.0, help="do_bench warm-up in ms (default %(default)g)")
    parser.add_argument("--rep", type=float, default=25.0, help="do_bench repetition time in ms "
                                                                "(default %(default)g)")
    parser.add_argument("--eager-rep", type=float, default=timing.EAGER_REP_MS,
                        help="repetition time in ms of the eager wall time (triton.testing.do_bench, host time "
                             "included) taken of each cell after its kernel time (default %(default)g)")
    parser.add_argument("--shortfalls", help="CSV of why cells fall short of their target (columns impl, op, "
                                             "direction, dtype, shape, why), for results.md (default: none)")
    parser.add_argument("--report-only", action="store_true",
                        help="time nothing: write results.md (and the plots) again from the CSV files and "
                             f"{ENVIRONMENT_FILE} in --out, e.g. after editing --shortfalls")
    args = parser.parse_args(argv)
    args.ops = (_choices(args.ops, plan.OPS + plan.EXTRA_OPS, plan.OP_ALIASES, "op", parser) if args.ops
                else list(plan.OPS))
    args.dtypes = _choices(args.dtypes, tuple(plan.DTYPES), plan.DTYPE_ALIASES, "dtype", parser)
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


def main(argv: list[str] | None = None, prog: str = "python -m multisoft bench") -> int:
    """Run the benchmark; 0 on success, 1 when there is no GPU (it says so and runs nothing), 2 on bad usage."""
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv), prog)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    out = Path(args.out)
    try:
        shortfalls = load_shortfalls(Path(args.shortfalls)) if args.shortfalls else None
        results = read_results(out) if args.report_only else None
    except (OSError, ValueError) as error:
        print(f"multisoft bench: {error}", file=sys.stderr)
        return 2
    if args.report_only:  # the CSV files stay as the run wrote them
        written = [write_markdown(results, out, shortfalls)]
    else:
        import torch

        if not torch.cuda.is_available():
            print(NO_GPU_MESSAGE, file=sys.stderr)
            return 1
        from .run import run

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
    from . import plots

    try:
        return plots.write_plots(results, out)
    except Exception as error:  # noqa: BLE001 - the CSV and Markdown are already written
        print(f"plots failed: {describe_error(error)}", file=sys.stderr)
        return []
