"""Offline look at CuPy kernels for sm_90, no GPU needed: registers, spills and the machine code's
instructions by opcode, for the kernels named on the command line (name expressions as in _catalog).

    python benchmarks/tune/cupy_resources.py [--source softmax.cu] [--file path.cu] [--sass DIR] EXPR...

NVRTC (pip's nvidia-cuda-nvrtc) compiles the source with ptxas's verbose output; Triton's bundled
cuobjdump disassembles the cubin. Memory-bound kernels live on bytes in flight (registers) and on how
few instructions each element takes, so this is the first look before spending GPU time.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backends"))
sys.path.insert(0, str(ROOT / "tests"))
from multisoft_cupy import _catalog  # noqa: E402
from test_cuda_sources_compile import NVRTC, _find_nvrtc  # noqa: E402
from triton_resources import cuobjdump  # noqa: E402  (this folder: Triton's bundled cuobjdump)


OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")  # a SASS line's opcode


def compile_cubin(nvrtc: NVRTC, code: str, name: str, expressions: list[str]) -> tuple[bytes, str, dict]:
    """The cubin, ptxas's log and each expression's lowered (mangled) name."""
    lib = nvrtc.lib
    prog = ctypes.c_void_p()
    created = lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None)
    nvrtc._check(created, "create")
    try:
        for expr in expressions:
            nvrtc._check(lib.nvrtcAddNameExpression(prog, expr.encode()), expr)
        options = ["--gpu-architecture=sm_90", "--ptxas-options=--verbose", *_catalog.OPTIONS]
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != 0:
            raise RuntimeError(log.value.decode())
        lowered = {}
        for expr in expressions:
            out = ctypes.c_char_p()
            nvrtc._check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), expr)
            lowered[expr] = out.value.decode()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, log.value.decode(), lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def sass_by_function(cubin: bytes) -> dict[str, list[str]]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = cuobjdump("-sass", f.name)
    functions, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
        elif current is not None:
            if OPCODE.match(line.strip()):
                current.append(line.strip())
    return functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("expressions", nargs="+")
    parser.add_argument("--source", default="softmax.cu", help="a file of the CuPy backend")
    parser.add_argument("--file", help="another .cu file instead (an A/B copy); its includes resolve in the "
                                       "backend's folder")
    parser.add_argument("--sass", help="write each kernel's machine code to this folder")
    args = parser.parse_args()
    path = pathlib.Path(args.file) if args.file else _catalog.PACKAGE_DIR / args.source
    nvrtc = NVRTC(_find_nvrtc() or sys.exit("no NVRTC installed: pip install nvidia-cuda-nvrtc"))
    cubin, log, lowered = compile_cubin(nvrtc, path.read_text(), path.name, args.expressions)
    functions = sass_by_function(cubin)
    for expr in args.expressions:
        name = lowered[expr]
        usage = re.search(rf"Compiling entry function '{re.escape(name)}'.*?Used (\d+) registers", log, re.S)
        spills = re.search(rf"Compiling entry function '{re.escape(name)}'.*?(\d+) bytes spill stores, "
                           rf"(\d+) bytes spill loads", log, re.S)
        code = functions.get(name, [])
        ops = collections.Counter(OPCODE.match(c).group(1) for c in code)
        print(f"{expr}: {usage.group(1) if usage else '?'} registers, spills "
              f"{spills.group(1) + '/' + spills.group(2) if spills else '?'} bytes (store/load), "
              f"{len(code)} instructions")
        print("   ", " ".join(f"{op}:{n}" for op, n in ops.most_common()))
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_]+", "_", expr).strip("_")
            pathlib.Path(args.sass, safe + ".sass").write_text("\n".join(code) + "\n")


if __name__ == "__main__":
    main()
