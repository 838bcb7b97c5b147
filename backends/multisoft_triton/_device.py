"""Device-side helpers (@triton.jit) shared by the op modules."""
import triton
import triton.language as tl

from . import simulated


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


if simulated():   # decided at import, like triton's own choice of the interpreter: it runs no PTX
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
