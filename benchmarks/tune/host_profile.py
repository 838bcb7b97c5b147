"""Where the host time of a block-sparse forward+backward call goes, by torch.profiler (CPU side).

The benchmark's forward+backward call (bench.prepare) costs more host time than its forward and backward apart;
this times the three calls on the host, then prints the profiler's table of host time for each, sorted by self
CPU time, so the extra time has a name.

    python3 benchmarks/tune/host_profile.py --backend triton --case 64:0.11:3 --dtype bf16
"""
import argparse
import gc
import statistics
import time

import torch

import multisoft
from multisoft import bench


class _GcClock:
    """A gc callback: collections by generation and the time they took since reset()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.counts, self.seconds, self.started = [0, 0, 0], [0.0, 0.0, 0.0], None

    def __call__(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self.started

    def __str__(self):
        return "gc " + ", ".join(f"gen{g} {n} ({t * 1e3:.1f} ms)" for g, (n, t) in
                                 enumerate(zip(self.counts, self.seconds)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--case", default="64:0.11:3", help="block:density:Z[:causal]")
    parser.add_argument("--dtype", default="bf16", choices=sorted(bench.DTYPES))
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--no-gc", action="store_true", help="with Python's cyclic garbage collector off")
    parser.add_argument("--no-table", action="store_true", help="without torch.profiler's tables")
    args = parser.parse_args(argv)
    if args.no_gc:
        gc.disable()
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
    collections = _GcClock()
    gc.callbacks.append(collections)
    print(f"objects the collector tracks: {len(gc.get_objects())}")
    for name, call in calls.items():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        bench._hold_gpu(200.0)  # the GPU busy for longer than the calls take to queue: the host never waits on it
        collections.reset()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - start) * 1e3 / args.calls
        torch.cuda.synchronize()
        print(f"{name:18s} host {host:.3f} ms a call; {collections}")
    # the forward+backward call's two halves timed apart, call by call (median and fastest)
    halves = ([], [])
    torch.cuda.synchronize()
    bench._hold_gpu(200.0)
    for _ in range(args.calls):
        start = time.perf_counter()
        out = f(xg)
        middle = time.perf_counter()
        torch.autograd.grad(out, xg, grad)
        halves[0].append(middle - start)
        halves[1].append(time.perf_counter() - middle)
    torch.cuda.synchronize()
    for name, times in zip(("its forward", "its backward"), halves):
        print(f"{name:18s} host {statistics.median(times) * 1e3:.3f} ms median, {min(times) * 1e3:.3f} fastest")
    for name, call in ([] if args.no_table else calls.items()):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                call()
        torch.cuda.synchronize()
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
