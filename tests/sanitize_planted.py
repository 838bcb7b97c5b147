"""Planted errors for tests/gpu_sanitize.sh: the sanitizer must report them, or its silence about the tests proves
nothing.

    python3 tests/sanitize_planted.py [N]   one float32 written past the end of a torch tensor of N elements
                                            (default 1000) from a Triton kernel: for memcheck
    python3 tests/sanitize_planted.py race  a shared-memory race in a kernel that CuPy compiles (each warp reads
                                            what the other writes, no barrier between them): for racecheck, which
                                            must see the kernels of modules loaded at run time, as the backends' are
"""
import sys

import torch

RACE_SOURCE = r"""
extern "C" __global__ void planted_race(float* out) {
    __shared__ float values[64];
    values[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = values[63 - threadIdx.x];  // no __syncthreads(): the other warp's value, written or not yet
}
"""


def plant_write(n: int) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_past_the_end(ptr, n):
        tl.store(ptr + n + tl.arange(0, 1), 1.0)

    buffer = torch.zeros(n, device="cuda")
    _write_past_the_end[(1,)](buffer, buffer.numel())
    torch.cuda.synchronize()
    print("planted write launched")


def plant_race() -> None:
    import cupy

    out = torch.zeros(64, device="cuda")
    with cupy.cuda.Device(out.device.index):  # on the default stream, which is torch's current one in this script
        cupy.RawKernel(RACE_SOURCE, "planted_race")((1,), (64,), (out.data_ptr(),))
    torch.cuda.synchronize()
    print("planted race launched")


if __name__ == "__main__":
    if sys.argv[1:2] == ["race"]:
        plant_race()
    else:
        plant_write(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
