"""The command line: ``multisoft info``, ``multisoft check``, ``multisoft bench`` (or ``python -m multisoft ...``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings

SIMULATION_VARIABLES = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"}
# (message, module) of the warnings that numpy raises where Triton's interpreter, or a kernel that numba's simulator
# runs as Python, computes a NaN or infinity that a GPU computes silently: lanes that hold only the -inf of a mask
# (rows of a block past the tensor's last row, elements past a row's end: -inf - -inf, 0 * inf, log 0), whose
# results no store keeps. `check` filters them, and only them; its table, against float64, says whether the
# results are right.
SIMULATION_WARNINGS = [(r"(invalid value|divide by zero) encountered in ", module)
                       for module in (r"triton\.runtime\.interpreter$", r"multisoft_numba\.")]


def _info(args) -> int:
    import torch

    import multisoft
    from multisoft._registry import ENV_VAR, environment_backends

    print(f"multisoft {multisoft.__version__}, python {platform.python_version()}, torch {torch.__version__}")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        print(f"GPU: {props.name} (compute capability {props.major}.{props.minor}, "
              f"{props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)), "
              f"CUDA {torch.version.cuda}")
    else:
        device = torch.device("cpu")
        print("GPU: none (no CUDA device visible to torch)")
    status = 0
    value = os.environ.get(ENV_VAR, "")
    try:
        environment_backends(value)
        print(f"{ENV_VAR}={value!r}" + ("" if value.strip() else " (unset: the automatic choice)"))
    except ValueError as error:
        print(f"INVALID {error}; every call that names no backend (backend= or use_backend) raises")
        status = 1
    print(f"backends, in default priority order, on {device}:")
    for backend in multisoft.backends(device):
        state = "available" if backend.available else f"unavailable: {backend.unavailable_reason}"
        if not backend.automatic:
            state += " (only when named: backend=, use_backend or $MULTISOFT_BACKEND)"
        print(f"  {backend.name:<10} {backend.version or '-':<32} {state}")
        print(f"  {'':<10} ops: {', '.join(backend.ops) or 'none'}")
        for note in backend.notes:
            print(f"  {'':<10} note: {note}")
    return status


class UsageError(Exception):
    """A command line that names something that does not exist or cannot run here: exit status 2."""


def _check(args) -> int:
    import torch

    import multisoft
    from multisoft._registry import OPS
    from multisoft.check import format_table, run_check

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    installed = {b.name: b for b in multisoft.backends(device)}
    if args.backends:
        names = [n.strip() for n in args.backends.split(",") if n.strip()]
        for name in names:
            if name not in installed:
                raise UsageError(f"unknown backend {name!r}; known backends: {', '.join(sorted(installed))}")
            if not installed[name].available:
                raise UsageError(f"backend {name!r} cannot run on {device}: {installed[name].unavailable_reason}")
    else:
        names = [b.name for b in installed.values() if b.available]
        for backend in installed.values():
            if not backend.available:
                print(f"skipped {backend.name}: {backend.unavailable_reason}")
        if len(names) < len(installed) and device.type == "cpu" and not args.simulate:
            print("(--simulate runs triton under its interpreter and numba under its CUDA simulator on the CPU)")
    for name in names:
        lacking = [op for op in OPS if op not in installed[name].ops]
        if lacking:
            print(f"skipped {name} for {', '.join(lacking)}: does not implement {'them' if len(lacking) > 1 else 'it'}")
    small = device.type == "cpu"
    print(f"checking {', '.join(names)} on {device} ({'small' if small else 'full'} shapes) "
          f"against float64 references ...", flush=True)
    with warnings.catch_warnings():
        for message, module in SIMULATION_WARNINGS:
            warnings.filterwarnings("ignore", message, RuntimeWarning, module)
        rows = run_check(device, names, small)
    print(format_table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _bench(rest: list[str], prog: str) -> int:
    from multisoft import bench

    return bench.main(rest, prog)


def main(argv: list[str] | None = None, prog: str = "multisoft") -> int:
    """The command line; returns the exit status. Output cut short by a closed pipe (``| head``) is not an error."""
    try:
        return _main(argv, prog)
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit: point stdout at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


INFO_DESCRIPTION = (
    "Print the versions of multisoft, Python and torch, the GPU, $MULTISOFT_BACKEND, and every installed backend "
    "in default priority order: its version, whether it can run here and why not, the ops it implements. Exit "
    "status 1 when $MULTISOFT_BACKEND names an unknown backend.")
CHECK_DESCRIPTION = (
    "Run every op (softmax, log_softmax, cross_entropy, linear_cross_entropy, block-sparse softmax), forward and "
    "backward, on every backend that can run here, in float32, float16 and bfloat16, against float64 references "
    "computed with torch ops, and print a table; exit status 1 when any result is outside its tolerance. "
    "On a CPU the shapes are small: seconds, or about half a minute with --simulate.")


def _main(argv: list[str] | None, prog: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="softmax, cross-entropy and block-sparse softmax on several backends: what is "
                               "installed here, whether it agrees with float64, how fast it runs")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="backends, their versions and availability, the GPU",
                        description=INFO_DESCRIPTION)
    check = commands.add_parser("check", help="every op on every backend that can run here vs float64",
                                description=CHECK_DESCRIPTION)
    check.add_argument("--backends", help="comma-separated backends to check (default: all that can run here)")
    check.add_argument("--simulate", action="store_true",
                       help="without a GPU, also run Triton under its interpreter and numba under its simulator")
    commands.add_parser("bench", help="time every op and backend against the copy bandwidth (needs a GPU)",
                        add_help=False)  # its own parser (multisoft.bench.command) describes it, --help too
    args, rest = parser.parse_known_args(argv)
    command = commands.choices[args.command]  # its errors print its own usage, not the top level's
    if args.command == "bench":
        return _bench(rest, command.prog)
    if rest:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "simulate", False):
        # This process is the program, not the library: set them before anything imports the frameworks.
        os.environ.update(SIMULATION_VARIABLES)
    try:
        return _info(args) if args.command == "info" else _check(args)
    except UsageError as error:
        command.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
