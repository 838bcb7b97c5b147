"""Device functions shared by the kernels: dtype codecs, bfloat16 bits, block reductions.

Every value is float32 inside. Kernels read and write "words": a float32 or float16
element (PLAIN), the int16 bits of one bfloat16 (BF16; numba has no bfloat16 arrays),
or an int32 holding two bfloat16 (BF16_PAIRS: one 4-byte access for two elements,
element 2i in the low half). Reductions go through shared memory, which the CUDA
simulator supports too.
"""

import math

import numpy
from numba import cuda, float32, int16, int32

from ._glue import SIMULATOR, device_function

NEG_INF = float32(-math.inf)
NAN = float32(math.nan)

if SIMULATOR:
    # Python's math raises where the GPU gives inf/NaN: use numpy's float32 semantics.
    def _float_as_int(v):
        return numpy.float32(v).view(numpy.int32)

    def _int_as_float(i):
        return numpy.int32(i).view(numpy.float32)

    def expf(v):
        with numpy.errstate(all="ignore"):
            return numpy.exp(numpy.float32(v))

    def logf(v):
        with numpy.errstate(all="ignore"):
            return numpy.log(numpy.float32(v))
else:
    from numba.cuda import libdevice

    _float_as_int = libdevice.float_as_int
    _int_as_float = libdevice.int_as_float
    # exp through ex2.approx (__expf): a few ulp, far inside the float32 tolerances, and
    # several times fewer instructions than the exact expf, which made the long-row
    # kernels instruction-bound.
    expf = libdevice.fast_expf
    logf = math.log


@device_function
def bf16_bits_to_float(bits):
    """The float32 whose upper half is the bfloat16 bits (exact)."""
    return _int_as_float(int32(int32(bits) << 16))


@device_function
def bf16_rounded(v):
    """An int32 whose upper half is v rounded to bfloat16 (to nearest even; NaN stays NaN,
    quieted, sign kept); the lower half is garbage."""
    u = int32(_float_as_int(v))
    if v != v:
        return int32(u | 0x400000)
    return int32(u + 0x7FFF + ((u >> 16) & 1))


@device_function
def float_to_bf16_bits(v):
    """float32 -> bfloat16 bits, rounded to nearest even; NaN stays NaN (quieted, sign kept)."""
    return int16(bf16_rounded(v) >> 16)


HIGH_HALF = int32(-65536)   # 0xFFFF0000
LOW_HALF = int32(0xFFFF)


@device_function
def pair_to_floats(word):
    """The two bfloat16 of an int32 word as float32: (low half, high half)."""
    return _int_as_float(int32(word << 16)), _int_as_float(int32(word & HIGH_HALF))


@device_function
def floats_to_pair(low, high):
    """Two float32 rounded to bfloat16 and packed into one int32 word (low half first)."""
    return int32((bf16_rounded(high) & HIGH_HALF) | ((bf16_rounded(low) >> 16) & LOW_HALF))


PLAIN, BF16, BF16_PAIRS = 0, 1, 2


@device_function
def unpack_plain(word):
    return (float32(word),)


@device_function
def unpack_bf16(word):
    return (bf16_bits_to_float(word),)


@device_function
def pack_plain(first, second):
    return first


@device_function
def pack_bf16(first, second):
    return float_to_bf16_bits(first)


def codec(kind):
    """(elements per word, unpack(word) -> tuple of its float32 elements,
    pack(first, second) -> word; `second` is ignored with one element per word)."""
    if kind == BF16_PAIRS:
        return 2, pair_to_floats, floats_to_pair
    if kind == BF16:
        return 1, unpack_bf16, pack_bf16
    return 1, unpack_plain, pack_plain


@device_function
def load(a, row, col, bf16):
    """a[row, col] as float32."""
    if bf16:
        return bf16_bits_to_float(a[row, col])
    return float32(a[row, col])


@device_function
def store(a, row, col, v, bf16):
    """a[row, col] = v, rounded to a's dtype (to nearest even)."""
    if bf16:
        a[row, col] = float_to_bf16_bits(v)
    else:
        a[row, col] = v


@device_function
def kahan_add(total, compensation, v):
    """Compensated summation step: long per-thread sums of signed terms stay accurate."""
    y = v - compensation
    t = total + y
    return t, (t - total) - y


@device_function
def nan_max(a, b):
    """max that propagates NaN."""
    if a > b or a != a:
        return a
    return b


@device_function
def online_add(m, s, v):
    """Add v to a running (max m, sum of expf(x - m)); -inf adds nothing, NaN poisons."""
    if v > m or v != v:
        return v, s * expf(m - v) + float32(1.0)
    if v != NEG_INF:
        return m, s + expf(v - m)
    return m, s


@device_function
def online_add_all(m, s, vals):
    """Add every value of the local array `vals` (padding -inf) to (m, s): one rescale per call."""
    top = NEG_INF
    for k in range(vals.shape[0]):
        top = nan_max(top, vals[k])
    if top > m or top != top:
        s = s * expf(m - top)
        m = top
    if m != NEG_INF:
        for k in range(vals.shape[0]):
            s += expf(vals[k] - m)
    return m, s


@device_function
def online_merge(m1, s1, m2, s2):
    """Merge two running (max, sum of exp) pairs."""
    if m2 > m1 or m2 != m2:
        m1, s1, m2, s2 = m2, s2, m1, s1
    if m2 == NEG_INF:
        return m1, s1
    return m1, s1 + s2 * expf(m2 - m1)


FULL_MASK = 0xFFFFFFFF


@device_function
def warp_sum(v):
    offset = 16
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


@device_function
def warp_max(v):
    offset = 16
    while offset > 0:
        v = nan_max(v, cuda.shfl_xor_sync(FULL_MASK, v, offset))
        offset //= 2
    return v


@device_function
def warp_online_merge(m, s):
    offset = 16
    while offset > 0:
        m, s = online_merge(m, s, cuda.shfl_xor_sync(FULL_MASK, m, offset),
                            cuda.shfl_xor_sync(FULL_MASK, s, offset))
        offset //= 2
    return m, s


# Block reductions (blockDim.x a multiple of 32, at most 1024; `buf` holds >= 32 floats)
# leave the result in every thread and `buf` free for reuse. On the GPU: warp shuffles,
# then each warp reduces the per-warp partials (two barriers). The simulator has no
# shuffles and pays a lot per barrier, so there every thread sums `buf` in order.

@device_function
def block_sum(buf, v):
    """Sum of v over the block; every thread gets it."""
    tid = cuda.threadIdx.x
    if SIMULATOR:
        buf[tid] = v
        cuda.syncthreads()
        total = float32(0.0)
        for k in range(cuda.blockDim.x):
            total += buf[k]
        cuda.syncthreads()
        return total
    v = warp_sum(v)
    if tid % 32 == 0:
        buf[tid // 32] = v
    cuda.syncthreads()
    lane = tid % 32
    v = buf[lane] if lane < cuda.blockDim.x // 32 else float32(0.0)
    v = warp_sum(v)
    cuda.syncthreads()
    return v


@device_function
def block_max(buf, v):
    """NaN-propagating max of v over the block; every thread gets it."""
    tid = cuda.threadIdx.x
    if SIMULATOR:
        buf[tid] = v
        cuda.syncthreads()
        total = NEG_INF
        for k in range(cuda.blockDim.x):
            total = nan_max(total, buf[k])
        cuda.syncthreads()
        return total
    v = warp_max(v)
    if tid % 32 == 0:
        buf[tid // 32] = v
    cuda.syncthreads()
    lane = tid % 32
    v = buf[lane] if lane < cuda.blockDim.x // 32 else NEG_INF
    v = warp_max(v)
    cuda.syncthreads()
    return v


@device_function
def block_online_merge(buf_m, buf_s, m, s):
    """Merge every thread's (max, sum of exp) pair; every thread gets the block's pair."""
    tid = cuda.threadIdx.x
    if SIMULATOR:
        buf_m[tid] = m
        buf_s[tid] = s
        cuda.syncthreads()
        m = NEG_INF
        s = float32(0.0)
        for k in range(cuda.blockDim.x):
            m, s = online_merge(m, s, buf_m[k], buf_s[k])
        cuda.syncthreads()
        return m, s
    m, s = warp_online_merge(m, s)
    if tid % 32 == 0:
        buf_m[tid // 32] = m
        buf_s[tid // 32] = s
    cuda.syncthreads()
    lane = tid % 32
    m = NEG_INF
    s = float32(0.0)
    if lane < cuda.blockDim.x // 32:
        m = buf_m[lane]
        s = buf_s[lane]
    m, s = warp_online_merge(m, s)
    cuda.syncthreads()
    return m, s


# Reductions over the lanes of kernels that give each warp its own row: shuffles on the GPU.
# The simulator has no shuffles: there such kernels run one "warp" per block (at most 32
# threads), reduced in shared memory, or a single thread with nothing to reduce.
if SIMULATOR:
    @device_function
    def lanes_online_merge(m, s):
        """Merge the (max, sum of exp) pairs of the warp's lanes; every lane gets the warp's pair."""
        if cuda.blockDim.x == 1:
            return m, s
        buf_m = cuda.shared.array(32, float32)
        buf_s = cuda.shared.array(32, float32)
        return block_online_merge(buf_m, buf_s, m, s)

    @device_function
    def lanes_sum(v):
        """Sum of v over the warp's lanes; every lane gets it."""
        if cuda.blockDim.x == 1:
            return v
        buf = cuda.shared.array(32, float32)
        return block_sum(buf, v)
else:
    lanes_online_merge = warp_online_merge
    lanes_sum = warp_sum
