"""Registers and spills of the numba softmax kernels, compiled for a GPU without one.

numba compiles a kernel to PTX for any compute capability without a device; the ptxas of pip's CUDA
compiler package (nvidia-cuda-nvcc, under site-packages/nvidia/cu*/bin, or one on PATH that reads
numba's PTX version) assembles it and reports registers and spill bytes. The kernels are compiled at
the launch bounds the backend gives them (most for 1024 threads, so at most 64 registers).

    python3 benchmarks/tune/numba_resources.py            # every configuration, sm_90

It compiles the sm_80+ intrinsics (max.NaN, packed max and rounding) that the backend uses where every
GPU is sm_80 or newer, and counts each kernel's machine instructions (with Triton's cuobjdump).

Run it without NUMBA_ENABLE_CUDASIM. numba compiles device functions for the current device's compute
capability; with no device this script answers that question itself (see _pretend_device).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numba
from triton_resources import cuobjdump  # this folder: Triton's bundled cuobjdump (imports triton when called)


def _pretend_device(cc):
    """numba asks the current device for the compute capability of device functions; without a GPU
    there is none, so the dispatcher is told `cc` (this process compiles only, it launches nothing)."""
    import numba.cuda.dispatcher as dispatcher

    class Device:
        compute_capability = cc

    dispatcher.get_current_device = lambda: Device()


def find_ptxas():
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(numba.__file__)),
                                               "nvidia", "cu*", "bin", "ptxas")), reverse=True)
    return candidates[0] if candidates else shutil.which("ptxas")


def configurations():
    """(name, kernel, argument types, launch bounds: threads or (threads, blocks)) for the softmax kernels of the
    benchmark shapes."""
    from numba import types

    from multisoft_numba import softmax
    from multisoft_numba._device import BF16, FP32
    from multisoft_numba._glue import MAX_THREADS

    rows = {FP32: types.Array(types.float32, 2, "C"), BF16: types.Array(types.int32, 2, "C")}
    stats = (types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C"), types.int64)
    found = []
    for fmt, name, width, held in ((FP32, "fp32", 4, 4), (BF16, "bf16", 8, 2), (BF16, "bf16-floats", 8, 4)):
        arr = rows[fmt]
        packed = held == 2
        for cache in softmax.CACHE[held]:
            build = softmax._forward_packed if packed else softmax._forward_cached
            found.append((f"fwd-cached-{name}-{cache}", build(fmt, width, False, cache, 0), (arr, arr), MAX_THREADS))
            if packed:
                prefetch = softmax._forward_packed_prefetch(fmt, width, False, cache)
                found.append((f"fwd-prefetch-{name}-{cache}", prefetch, (arr, arr), MAX_THREADS))
        for cache in softmax.CACHE_BWD[held]:
            build = softmax._backward_packed if packed else softmax._backward_cached
            found.append((f"bwd-cached-{name}-{cache}", build(fmt, width, False, cache, 0), (arr, arr, arr),
                          MAX_THREADS))
        for threads, cache, blocks in softmax.SPLIT_FORWARD[held]:
            plan = softmax.Plan("split", threads, 1, cache, 0, blocks)
            kernel = softmax.forward_split_kernel(fmt, width, False, held, plan)
            found.append((f"fwd-split-{name}-{threads}x{cache}", kernel, (arr, arr, *stats), plan.bound or MAX_THREADS))
        for threads, cache, blocks in softmax.SPLIT_BWD[held]:
            plan = softmax.Plan("split", threads, 1, cache, 0, blocks)
            for log, op in ((False, ""), (True, "-log")):
                kernel = softmax.backward_split_kernel(fmt, width, log, held, plan)
                found.append((f"bwd-split{op}-{name}-{threads}x{cache}", kernel, (arr, arr, arr, *stats),
                              plan.bound or MAX_THREADS))
    found += blocksparse_configurations()
    return found


def blocksparse_configurations():
    """The block-sparse kernels at the launch shape of the bench layouts (rows of about 1024 elements)."""
    from numba import types

    from multisoft_numba import blocksparse
    from multisoft_numba._device import BF16, FP32

    words = {FP32: types.Array(types.float32, 1, "C"), BF16: types.Array(types.int32, 1, "C")}
    table = types.Array(types.int32, 1, "C")
    sizes = (types.int64,) * 4
    found = []
    for fmt, name, width in ((FP32, "fp32", 4), (BF16, "bf16", 8)):
        arr = words[fmt]
        lanes, warps, _, backward = blocksparse._launch_shape(1, 1 << 20, 1040, width, 16 // width, 64, "backward")
        packed = blocksparse._packed(width, 16 // width)
        build_forward = blocksparse._forward_packed_kernel if packed else blocksparse._forward_kernel
        build_backward = blocksparse._backward_packed_kernel if packed else blocksparse._backward_kernel
        tag = "-words" if packed else ""
        for causal in (False, True):
            f_lanes, f_warps, _, forward = blocksparse._launch_shape(1, 1 << 20, 1040, width, 16 // width, 64,
                                                                     "forward", causal=causal)
            found.append((f"bs-fwd-{name}{'-causal' if causal else ''}{tag}-{forward}",
                          build_forward(fmt, width, causal, forward, f_lanes, f_warps),
                          (arr, arr, table, table, *sizes[:3], types.int64, types.int64, types.float32, types.int64),
                          f_lanes * f_warps))
        for stash in (0,) if packed else (0, blocksparse.BACKWARD_STASH_TILES):
            found.append((f"bs-bwd-{name}{tag}-{backward}{f'-stash{stash}' if stash else ''}",
                          build_backward(fmt, width, backward, lanes, warps, *([stash] if stash else [])),
                          (arr, arr, arr, table, *sizes, types.int64, types.float32), lanes * warps))
    return found


def report(kernel, argtypes, cc, ptxas, bound, sass_to=None):
    from numba import cuda

    ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc, launch_bounds=bound)
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        arch = f"-arch=sm_{cc[0]}{cc[1]}"
        out = subprocess.run([ptxas, arch, "-v", source, "-o", os.path.join(folder, "kernel.o")],
                             capture_output=True, text=True)
        instructions = count_instructions(os.path.join(folder, "kernel.o"), sass_to)
    text = out.stderr + out.stdout
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas said: {text.strip()[-400:]}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2)), instructions


def count_instructions(cubin, sass_to=None):
    """Machine instructions in the cubin (Triton's bundled cuobjdump), or -1 without one; the machine code
    is written to the file `sass_to` if given."""
    try:
        sass = cuobjdump("-sass", cubin)
    except (ImportError, OSError, subprocess.CalledProcessError):
        return -1
    if sass_to:
        with open(sass_to, "w") as handle:
            handle.write(sass)
    return len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (default 90)")
    parser.add_argument("--only", default="", help="names containing this")
    parser.add_argument("--sass", default="", help="write each kernel's SASS into this folder")
    args = parser.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("unset NUMBA_ENABLE_CUDASIM: the simulator compiles nothing", file=sys.stderr)
        return 2
    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas: pip install nvidia-cuda-nvcc (the CUDA compiler package)", file=sys.stderr)
        return 2
    cc = (args.arch // 10, args.arch % 10)
    _pretend_device(cc)
    import multisoft_numba._glue as glue  # before _device, which picks its intrinsics by it

    glue.SM80_EVERYWHERE = args.arch >= 80
    print(f"numba-cuda, sm_{args.arch}, {ptxas}")
    print(f"{'configuration':33} {'bound':>8} {'regs':>4} {'spill stores':>12} {'spill loads':>11} "
          f"{'instructions':>12}")
    for name, kernel, argtypes, bound in configurations():
        if args.only not in name:
            continue
        sass_to = None
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            sass_to = os.path.join(args.sass, name + ".sass")
        registers, stores, loads, instructions = report(kernel, argtypes, cc, ptxas, bound, sass_to)
        print(f"{name:33} {str(bound).replace(' ', ''):>8} {registers:4d} {stores:12d} {loads:11d} {instructions:12d}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
