"""Why cross-entropy forward+backward with inplace_backward=True reads slower than without at some shapes.

The in-place timing overwrites the logits with the gradient on every call, so from the second call on it runs on
the gradient's values. This times, per backend, dtype and shape, as `python -m multisoft bench` does: the ordinary
forward+backward on random logits, the in-place one, and the ordinary one on the values that in-place calls leave
(the gradient of a gradient ...), so that a difference of kernels (aliasing) and one of values can be told apart.

    python3 benchmarks/tune/ce_inplace.py --backends triton,cupy --dtypes bf16,fp32 --shapes 8192x32000
"""
import argparse
import sys
import time

import torch

from multisoft import bench


def host_us_per_call(fn, calls=10):
    """The host's time to queue one call, the GPU held busy meanwhile (no call waits for the GPU)."""
    torch.cuda.synchronize()
    bench._hold_gpu(200.0)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton,cupy,numba")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--shapes", default="8192x32000,8192x128256")
    parser.add_argument("--rounds", type=int, default=8, help="in-place calls that make the 'settled' values")
    args = parser.parse_args(argv)
    timer = lambda fn: bench.queued_bench(fn, 5.0, 25.0)  # noqa: E731
    copy = bench.gb_per_s(2 * bench.COPY_BYTES, bench.copy_ms(timer))
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    direction = "forward+backward"
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        case = bench.dense_cases("cross_entropy", [(rows, cols)], [])[0]
        for dtype in args.dtypes.split(","):
            inputs = bench.make_inputs(case, dtype)
            nbytes = bench.bytes_moved("cross_entropy", direction, rows * cols, bench.ELEMENT_SIZE[dtype])
            for name in args.backends.split(","):
                plain, inplace = bench._backend_impl(name), bench._inplace_impl(name)
                settled = inputs["x"].detach().clone().requires_grad_(True)
                step = inplace.make("cross_entropy", inputs)
                for _ in range(args.rounds):
                    torch.autograd.grad(step(settled), settled)
                settled = settled.detach()
                print(f"{name} {dtype} {shape}: settled logits min {settled.min().item():.3g} max "
                      f"{settled.max().item():.3g} finite {bool(torch.isfinite(settled).all())}", flush=True)
                timings = (("random", plain, inputs), ("inplace", inplace, inputs),
                           ("settled", plain, dict(inputs, x=settled)), ("inplace-settled", inplace,
                                                                         dict(inputs, x=settled)))
                for label, impl, given in timings:
                    fn = bench.prepare(impl, "cross_entropy", direction, given)
                    ms = timer(fn)
                    host = host_us_per_call(fn)
                    print(f"{name:>6} {dtype} {shape:>12} {label:>16} {ms:8.4f} ms  "
                          f"{bench.gb_per_s(nbytes, ms) / copy:5.3f}  host {host:8.1f} us/call", flush=True)
                del settled
            del inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
