"""Runs chosen forwards once each inside a CUDA profiler range, for Nsight Compute.

Every backend is called a few times first (compiles, caches), then torch.cuda.profiler.start(), one call
per (backend, shape, dtype) and, for comparison, a torch kernel that moves the same bytes: x * 1 for
softmax, log_softmax and blocksparse (reads and writes each element once, as their forwards should),
x.sum(1) for cross_entropy (reads each logit once), then stop(). --op blocksparse takes the benchmark's
layouts (`--cases` as block:density[:causal], e.g. 64:0.25:causal) over 16 heads of 4096. Under

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
    parser.add_argument("--op", default="softmax", choices=("softmax", "log_softmax", "cross_entropy", "blocksparse"))
    parser.add_argument("--log", action="store_true", help="the same as --op log_softmax")
    args = parser.parse_args(argv)
    op = "log_softmax" if args.log else args.op
    runs = []
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            call, x, peer = _case(op, case, DTYPES[dtype])
            for backend in args.backends.split(","):
                for _ in range(3):
                    call(backend)
                runs.append((backend, call, x))
            runs.append(("torch", peer, x))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for backend, call, _ in runs:
        call(backend)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for backend, _, x in runs:
        print(f"ran {op} {backend} {tuple(x.shape)} {x.dtype}")


def _case(op, case, dtype):
    """(call(backend), input, torch's peer call) for one case of `op`."""
    if op == "blocksparse":
        from multisoft import bench
        block, density, *causal = case.split(":")
        block, causal = int(block), bool(causal)
        layout = bench.make_layout(block, float(density), causal, bench.HEADS, bench.SEQ).cuda()
        x = torch.randn(1, int(layout.sum()), block, block, device="cuda").to(dtype)
        return (lambda backend: multisoft.blocksparse_softmax(x, layout, block, scale=bench.SCALE, is_causal=causal,
                                                              backend=backend),
                x, lambda _: torch.mul(x, 1.0))
    rows, cols = map(int, case.split("x"))
    x = torch.randn(rows, cols, device="cuda").mul(3).to(dtype)
    if op == "cross_entropy":
        target = torch.randint(0, cols, (rows,), device="cuda")
        return (lambda backend: multisoft.cross_entropy(x, target, backend=backend), x,
                lambda _: torch.sum(x, 1))
    function = multisoft.log_softmax if op == "log_softmax" else multisoft.softmax
    return lambda backend: function(x, -1, backend=backend), x, lambda _: torch.mul(x, 1.0)


if __name__ == "__main__":
    main()
