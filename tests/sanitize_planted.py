"""A planted out-of-bounds write for tests/gpu_sanitize.sh: the sanitizer must report it, or its silence about the
tests proves nothing. Writes one float32 past the end of a torch tensor of N elements (argument, default 1000) from
a Triton kernel."""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _write_past_the_end(ptr, n):
    tl.store(ptr + n + tl.arange(0, 1), 1.0)


if __name__ == "__main__":
    buffer = torch.zeros(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, device="cuda")
    _write_past_the_end[(1,)](buffer, buffer.numel())
    torch.cuda.synchronize()
    print("planted write launched")
