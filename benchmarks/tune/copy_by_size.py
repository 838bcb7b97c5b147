"""The copy bandwidth of each benchmark shape's bytes, as a fraction of the benchmark's 1 GiB copy.

`python -m multisoft bench` now reports this too (results.md, "copy of each headline shape's bytes");
this script measures it alone, in seconds.

The benchmark reports every kernel against one long copy (1 GiB read and written). A short kernel also
pays its launch, ramp-up and tail: a copy of the same bytes shows how much of that fraction any kernel
of that size can reach. Timed exactly as the benchmark times kernels (queued CUDA events, L2 cleared).

    python3 benchmarks/tune/copy_by_size.py
"""
import torch

from multisoft import bench


def main():
    timer = lambda fn: bench.queued_bench(fn, 5.0, 25.0)  # noqa: E731
    reference = bench.gb_per_s(2 * bench.COPY_BYTES, bench.copy_ms(timer))
    print(f"copy bandwidth (1 GiB): {reference:.0f} GB/s")
    shapes = ([(m, n, "softmax") for m, n in bench.HEADLINE]
              + [(m, n, "cross_entropy") for m, n in bench.CROSS_ENTROPY])
    for m, n, op in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            ms, nbytes = bench._copy_of(timer, (m, n), dtype)
            fraction = bench.gb_per_s(nbytes, ms) / reference
            print(f"{op:>14} {m}x{n} {str(dtype)[6:]:>8}: copy of {nbytes // 2 >> 20} MiB "
                  f"{ms * 1e3:7.1f} us, {fraction:.3f} of the 1 GiB copy", flush=True)


if __name__ == "__main__":
    main()
