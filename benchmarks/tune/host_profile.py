"""Where the host time of a block-sparse forward+backward call goes, by torch.profiler (CPU side).

The benchmark's forward+backward call (bench.prepare) costs more host time than its forward and backward apart;
this times the three calls on the host, then prints the profiler's table of host time for each, sorted by self
CPU time, so the extra time has a name.

    python3 benchmarks/tune/host_profile.py --backend triton --case 64:0.11:3 --dtype bf16
"""
import argparse
import time

import torch

import multisoft
from multisoft import bench


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--case", default="64:0.11:3", help="block:density:Z[:causal]")
    parser.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    block, density, z, *causal = args.case.split(":")
    block, z, causal = int(block), int(z), bool(causal)
    dtype = getattr(torch, bench.DTYPES[args.dtype])
    layout = bench.make_layout(block, float(density), causal, bench.HEADS, bench.SEQ).cuda()
    x = torch.randn(z, int(layout.sum()), block, block, device="cuda").to(dtype)
    grad = torch.randn_like(x)

    def f(t):
        return multisoft.blocksparse_softmax(t, layout, block, scale=bench.SCALE, is_causal=causal,
                                             backend=args.backend)

    xg = x.detach().requires_grad_(True)
    y = f(xg)
    calls = {
        "forward": lambda: f(x),
        "forward (grad)": lambda: f(xg),
        "backward": lambda: torch.autograd.grad(y, xg, grad, retain_graph=True),
        "forward+backward": lambda: torch.autograd.grad(f(xg), xg, grad),
    }
    for name, call in calls.items():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        bench._hold_gpu(200.0)  # the GPU busy for longer than the calls take to queue: the host never waits on it
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - start) * 1e3 / args.calls
        torch.cuda.synchronize()
        print(f"{name:18s} host {host:.3f} ms a call")
    for name, call in calls.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                call()
        torch.cuda.synchronize()
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
