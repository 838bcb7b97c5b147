"""Small launch helpers shared by the kernel modules."""
import contextlib
import functools
import os

import torch
import triton
import triton.language as tl


# Options of every launch. The kernels were tuned with a * b + c compiled as one FMA, triton's default through 3.9,
# which warns that 3.10 will no longer fuse by default (TRITON_DEFAULT_FP_FUSION): they ask for it.
LAUNCH = {"enable_fp_fusion": True}


def on_device(tensor):
    """Context that makes `tensor`'s CUDA device current (triton launches on its current stream)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(tensor):
    """Streaming multiprocessors of `tensor`'s GPU (0 on CPU)."""
    if not tensor.is_cuda:
        return 0
    return _sm_count(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def next_power_of_2(n):
    return triton.next_power_of_2(max(1, int(n)))


def warps_for(elements):
    """num_warps giving each thread about 32 elements of a tile (4..32 warps)."""
    return max(4, min(32, elements // 1024))


@triton.jit
def safe_shift(row_max):
    """The shift for exp(x - shift): the row's max, or 0 where the row is -inf only, so that its
    exponentials are 0 instead of NaN."""
    return tl.where(row_max == -float("inf"), 0.0, row_max)


@triton.jit
def online_max(run_max, run_sum, block_max):
    """Fold a block's max into a running (max, sum of exp(x - max)): the new max, the shift for the
    block's exponentials (0 while everything seen is -inf), and the running sum rescaled to that shift."""
    new_max = tl.maximum(run_max, block_max)
    # safe_shift(new_max), written out: through the helper the cross-entropy loop compiles differently
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    return new_max, shift, run_sum * tl.exp(run_max - shift)


@triton.jit
def widen_again(raw, opaque_zero):
    """16-bit `raw` as float32, its bits first xor-ed with `opaque_zero`, a run-time 0 the compiler cannot
    see through. A kernel that widens the same values in two passes would otherwise have the second
    reuse the first's floats and keep them (two registers per pair of 16-bit values) between the passes;
    this way it keeps the 16-bit values (one register per pair) and widens them again."""
    bits = raw.to(tl.int16, bitcast=True) ^ opaque_zero.to(tl.int16)
    return bits.to(raw.dtype, bitcast=True).to(tl.float32)


@triton.jit
def widen(held, opaque_zero, RAW: tl.constexpr):
    """`held` (as loaded) as float32: with RAW through widen_again, so that a kernel holding 16-bit values
    across a reduction keeps them as loaded; otherwise a plain conversion, which the compiler shares with
    any other conversion of the same values."""
    if RAW:
        return widen_again(held, opaque_zero)
    return held.to(tl.float32)


if interpreting():   # decided at import, like triton's own choice of the interpreter: it runs no PTX
    @triton.jit
    def fast_exp(x):
        return tl.exp(x)

    @triton.jit
    def fast_exp2(x):
        return tl.exp2(x)
else:
    @triton.jit
    def fast_exp2(x):
        """2**x as one ex2.approx.ftz: results below 2**-126 are flushed to zero, which spares the three
        instructions per element (a compare and two multiplies) of tl.exp2's subnormal range fix-up."""
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def fast_exp(x):
        """exp(x) as fast_exp2(x * log2 e)."""
        return fast_exp2(x * 1.4426950408889634)
