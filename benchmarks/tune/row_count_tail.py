"""Whether the forward of whole-row programs loses a last partial wave: bf16 softmax forward of rows of N columns
at row counts that are a multiple of the multiprocessors and at the benchmark's count in between.

A program (Triton, numba) or block (CuPy) that holds a whole row of 32768 columns runs one row at a time per
multiprocessor: with M = 4096 rows on 132 multiprocessors, 4 of them run a 32nd row while the rest idle. Timed as
the benchmark times kernels (queued CUDA events, L2 cleared), as a fraction of its 1 GiB copy.

    python3 benchmarks/tune/row_count_tail.py [--columns 32768] [--backends triton,numba,cupy]
"""
import argparse

import torch

import multisoft
from multisoft import bench


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--columns", type=int, default=32768)
    parser.add_argument("--backends", default="triton,numba,cupy")
    args = parser.parse_args(argv)
    timer = lambda fn: bench.queued_bench(fn, 5.0, 25.0)  # noqa: E731
    reference = bench.gb_per_s(2 * bench.COPY_BYTES, bench.copy_ms(timer))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth (1 GiB): {reference:.0f} GB/s; {sms} multiprocessors")
    counts = sorted({31 * sms, 4096, 32 * sms})
    for backend in args.backends.split(","):
        for rows in counts:
            x = torch.randn(rows, args.columns, device="cuda", dtype=torch.bfloat16)
            ms = timer(lambda: multisoft.softmax(x, dim=-1, backend=backend))
            nbytes = bench.bytes_moved("softmax", "forward", x.numel(), x.element_size())
            waves = rows / sms
            print(f"{backend:>7} softmax bf16 {rows}x{args.columns} forward ({waves:.2f} rows a multiprocessor) "
                  f"{ms * 1e3:7.1f} us {bench.gb_per_s(nbytes, ms) / reference:.3f}", flush=True)


if __name__ == "__main__":
    main()
