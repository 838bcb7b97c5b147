"""Runs chosen softmax forwards once each inside a CUDA profiler range, for Nsight Compute.

Every backend is called a few times first (compiles, caches), then torch.cuda.profiler.start(), one call
per (backend, shape, dtype) and, for comparison, torch's elementwise x * 1 of the same input (a kernel that
reads and writes each element once, as a forward should), then stop(). Under

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/tune/profile_forward.py --backends cupy,triton --cases 1024x131072 --dtypes bf16

ncu sees only those kernels. Without ncu it just runs them.
"""
import argparse

import torch

import multisoft

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cupy,triton,numba")
    parser.add_argument("--cases", default="1024x131072")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--log", action="store_true", help="log_softmax instead of softmax")
    args = parser.parse_args(argv)
    op = multisoft.log_softmax if args.log else multisoft.softmax
    runs = []
    for case in args.cases.split(","):
        rows, cols = map(int, case.split("x"))
        for dtype in args.dtypes.split(","):
            x = torch.randn(rows, cols, device="cuda").mul(3).to(DTYPES[dtype])
            for backend in args.backends.split(","):
                for _ in range(3):
                    op(x, -1, backend=backend)
                runs.append((backend, x))
            runs.append(("x * 1", x))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for backend, x in runs:
        if backend == "x * 1":
            torch.mul(x, 1.0)
        else:
            op(x, -1, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for backend, x in runs:
        print(f"ran {backend} {tuple(x.shape)} {x.dtype}")


if __name__ == "__main__":
    main()
