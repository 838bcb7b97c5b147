"""Device functions shared by the kernels: reading and writing rows, bfloat16 bits, reductions.

Every value is float32 inside. Kernels read and write rows in vectors of 1 to 8
elements, one memory access each (row_io, strided_io): the host picks the widest
vector the rows' lengths and alignment allow (_launch.vector_views). Memory holds
float32 words, or 16-bit elements (float16, bfloat16: numba has neither as an array
we can use) as int32 pairs or int16. Reductions go through shared memory, which the
CUDA simulator supports too.
"""

import functools
import math

import numpy
from numba import cuda, float32, int16, int32, int64, uint64

from ._launch import BF16, FP32, SIMULATOR, SM80_EVERYWHERE, device_function
from ._intrinsics import fast_exp as expf
from ._intrinsics import fast_exp2 as exp2f
from ._intrinsics import float_to_half_bits, half_bits_to_float, vector_access

if SM80_EVERYWHERE:
    from ._intrinsics import max_pairs_bf16, max_pairs_f16, max_propagating_nan, pack_bf16x2, pack_f16x2

NEG_INF = float32(-math.inf)
NAN = float32(math.nan)

if SIMULATOR:
    # Python's math raises where the GPU gives inf/NaN: use numpy's float32 semantics.
    def _float_as_int(v):
        return numpy.float32(v).view(numpy.int32)

    def _int_as_float(i):
        return numpy.int32(i).view(numpy.float32)

    def logf(v):
        with numpy.errstate(all="ignore"):
            return numpy.log(numpy.float32(v))
else:
    from numba.cuda import libdevice

    _float_as_int = libdevice.float_as_int
    _int_as_float = libdevice.int_as_float
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


LOW_HALF = int32(0xFFFF)


def word_layout(fmt, width):
    """(word dtype, words per vector) of `width`-element vectors: float32 words for FP32;
    16-bit elements go as int32 pairs (element 2i in the low half), or as int16 when a
    vector holds one element."""
    if fmt == FP32:
        return float32, width
    if width == 1:
        return int16, 1
    return int32, width // 2


@functools.cache
def row_io(fmt, width):
    """(read(array, i, vals, at), write(array, i, vals, at)) for vectors of `width` elements:
    read puts the float32 values of elements [i * width, (i + 1) * width) of a 1-D word
    array (see word_layout) into vals[at:at + width]; write stores vals[at:at + width]
    there, rounded to the format (to nearest even). One memory access per vector."""
    word, words = word_layout(fmt, width)
    load_words, store_words = vector_access(words)
    decode, encode = (bf16_bits_to_float, float_to_bf16_bits) if fmt == BF16 else \
        (half_bits_to_float, float_to_half_bits)
    if SM80_EVERYWHERE:
        pack_two = pack_bf16x2 if fmt == BF16 else pack_f16x2
    else:
        @device_function
        def pack_two(low, high):
            return int32((int32(encode(high)) << 16) | (int32(encode(low)) & LOW_HALF))

    @device_function
    def read_through(array, i, vals, at, raw):
        load_words(array, i, raw)
        for j in range(words):
            if fmt == FP32:
                vals[at + j] = raw[j]
            elif width == 1:
                vals[at] = decode(raw[0])
            else:
                vals[at + 2 * j] = decode(raw[j])
                vals[at + 2 * j + 1] = decode(raw[j] >> 16)

    @device_function
    def write_through(array, i, vals, at, raw):
        for j in range(words):
            if fmt == FP32:
                raw[j] = vals[at + j]
            elif width == 1:
                raw[0] = int16(encode(vals[at]))
            else:
                raw[j] = pack_two(vals[at + 2 * j], vals[at + 2 * j + 1])
        store_words(array, i, raw)

    # The words pass through a local array. Under the simulator that is a numpy array made
    # here, so that read and write stay plain functions (see _launch.device_function).
    if SIMULATOR:
        def read(array, i, vals, at):
            read_through(array, i, vals, at, numpy.empty(words, word.name))

        def write(array, i, vals, at):
            write_through(array, i, vals, at, numpy.empty(words, word.name))
    else:
        @device_function
        def read(array, i, vals, at):
            read_through(array, i, vals, at, cuda.local.array(words, word))

        @device_function
        def write(array, i, vals, at):
            write_through(array, i, vals, at, cuda.local.array(words, word))

    return read, write


@functools.cache
def strided_io(fmt, width, count):
    """(read_vectors(array, first, step, limit, vals, pad), write_vectors(array, first, step,
    limit, vals)): the `count` vectors first, first + step, ... of a 1-D word array into
    vals (count * width floats) or from it; vectors at or past `limit` are not accessed
    (read pads their places in vals with `pad`)."""
    read, write = row_io(fmt, width)

    @device_function
    def read_vectors(array, first, step, limit, vals, pad):
        for k in range(count):
            c = first + k * step
            if c < limit:
                read(array, c, vals, k * width)
            else:
                for j in range(width):
                    vals[k * width + j] = pad

    @device_function
    def write_vectors(array, first, step, limit, vals):
        for k in range(count):
            c = first + k * step
            if c < limit:
                write(array, c, vals, k * width)

    return read_vectors, write_vectors


HALF_SHIFT = 16   # bits from a 16-bit element's place in its word to the next element's


def packed_pad(fmt, pad):
    """The word holding two 16-bit copies of `pad` (-inf or 0), for the places past a row's end."""
    if pad == 0:
        return int32(0)
    bits = 0xFF80 if fmt == BF16 else 0xFC00
    return int32((bits << 16 | bits) - (1 << 32))


@functools.cache
def packed_io(fmt, width, count):
    """(read_packed(array, first, step, limit, raw, pad), unpack(raw, k, shift)) for 16-bit rows held
    as their words, two elements per int32: half the registers of the same elements as floats.

    read_packed puts the words of the `count` vectors first, first + step, ... of a 1-D word array
    (see word_layout; width >= 2) into raw (count * width / 2 int32), `pad` (packed_pad) for vectors
    at or past `limit`. unpack gives element k of raw as float32; `shift` must be HALF_SHIFT. A pass
    that unpacks again after a barrier takes `shift` from shared memory (see fresh_shift), so the
    compiler cannot reuse an earlier pass's floats and keep them alive instead of the words."""
    words = width // 2
    load_words, _ = vector_access(words)

    @device_function
    def read_through(array, first, step, limit, raw, pad, tmp):
        for k in range(count):
            c = first + k * step
            if c < limit:
                load_words(array, c, tmp)
                for j in range(words):
                    raw[k * words + j] = tmp[j]
            else:
                for j in range(words):
                    raw[k * words + j] = pad

    if SIMULATOR:
        def read_packed(array, first, step, limit, raw, pad):
            read_through(array, first, step, limit, raw, pad, numpy.empty(words, "int32"))
    else:
        @device_function
        def read_packed(array, first, step, limit, raw, pad):
            read_through(array, first, step, limit, raw, pad, cuda.local.array(words, int32))

    @device_function
    def unpack(raw, k, shift):
        w = raw[k // 2]
        if fmt == BF16:
            if k % 2 == 0:
                return _int_as_float(int32(w << shift))
            return _int_as_float(int32(w & (int32(-1) << shift)))
        if k % 2 == 0:
            return half_bits_to_float(int32(w >> (shift - HALF_SHIFT)))
        return half_bits_to_float(int32(w >> shift))

    return read_packed, unpack


@device_function
def fresh_shift(slot):
    """HALF_SHIFT, read from the shared int32 slot[0] (set by share_shift before a barrier)."""
    return slot[0]


@device_function
def share_shift(slot):
    if cuda.threadIdx.x == 0:
        slot[0] = HALF_SHIFT


@device_function
def kahan_add(total, compensation, v):
    """Compensated summation step: long per-thread sums of signed terms stay accurate."""
    y = v - compensation
    t = total + y
    return t, (t - total) - y


@device_function
def _nan_max(a, b):
    """max that propagates NaN."""
    if a > b or a != a:
        return a
    return b


nan_max = max_propagating_nan if SM80_EVERYWHERE else _nan_max


@functools.cache
def packed_max(fmt):
    """(pair_max(a, b), word_max(w)) for 16-bit values held as words (packed_io): the word holding the
    larger value of each half of a and b (NaN where either is NaN), and the larger of w's two values as
    float32. A row held as words finds its max without widening each value."""
    @device_function
    def value(w, at):
        return bf16_bits_to_float(w >> at) if fmt == BF16 else half_bits_to_float(w >> at)

    @device_function
    def word_max(w):
        return nan_max(value(w, 0), value(w, HALF_SHIFT))

    if SM80_EVERYWHERE:
        return (max_pairs_bf16 if fmt == BF16 else max_pairs_f16), word_max

    @device_function
    def larger_half(a, b, at):
        va = value(a, at)
        vb = value(b, at)
        return int32((a >> at) & 0xFFFF) if va > vb or va != va else int32((b >> at) & 0xFFFF)

    @device_function
    def pair_max(a, b):
        return int32(larger_half(a, b, 0) | (larger_half(a, b, HALF_SHIFT) << HALF_SHIFT))

    return pair_max, word_max


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


@functools.cache
def shuffle_reductions(width):
    """(max(v), sum(v)) over each aligned group of `width` lanes (a power of two, at most 32) by shuffles,
    every lane getting its group's result; the max propagates NaN. The whole warp must take part."""
    @device_function
    def lanes_max(v):
        offset = width // 2
        while offset > 0:
            v = nan_max(v, cuda.shfl_xor_sync(FULL_MASK, v, offset))
            offset //= 2
        return v

    @device_function
    def lanes_sum(v):
        offset = width // 2
        while offset > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
            offset //= 2
        return v

    return lanes_max, lanes_sum


warp_max, warp_sum = shuffle_reductions(32)


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


@functools.cache
def row_groups(group):
    """(thread_row(rows, limit), group_max(buf, v), group_sum(buf, v)) for blocks whose rows each take
    `group` consecutive threads (a power of two, at most 32), blockDim.x // group rows a block; group 0: one
    row, the whole block (block_max, block_sum).

    thread_row gives this thread's (row, lane, lanes, limit): its row (clamped into the tensor), its place
    among the row's `lanes` threads, and the row's `limit` (the vectors to read), 0 past the last row. A group
    past the last row then reads padding and writes nothing instead of returning, so that each warp stays
    whole for its shuffles. The reductions give every thread of a group the group's result."""
    if group == 0:
        @device_function
        def block_row(rows, limit):
            return uint64(cuda.blockIdx.x), cuda.threadIdx.x, cuda.blockDim.x, limit

        return block_row, block_max, block_sum

    @device_function
    def thread_row(rows, limit):
        tid = cuda.threadIdx.x
        row = int64(cuda.blockIdx.x) * (cuda.blockDim.x // group) + tid // group
        if row < rows:
            return uint64(row), tid % group, group, limit
        return uint64(rows - 1), tid % group, group, limit - limit

    if SIMULATOR:  # no shuffles: each thread reduces its group's slots of `buf` in order
        @device_function
        def group_max(buf, v):
            tid = cuda.threadIdx.x
            buf[tid] = v
            cuda.syncthreads()
            total = NEG_INF
            for k in range(tid - tid % group, tid - tid % group + group):
                total = nan_max(total, buf[k])
            cuda.syncthreads()
            return total

        @device_function
        def group_sum(buf, v):
            tid = cuda.threadIdx.x
            buf[tid] = v
            cuda.syncthreads()
            total = float32(0.0)
            for k in range(tid - tid % group, tid - tid % group + group):
                total += buf[k]
            cuda.syncthreads()
            return total

        return thread_row, group_max, group_sum

    lanes_max, lanes_sum = shuffle_reductions(group)

    @device_function
    def group_max(buf, v):
        return lanes_max(v)

    @device_function
    def group_sum(buf, v):
        return lanes_sum(v)

    return thread_row, group_max, group_sum


# Reductions over the lanes of kernels that give each warp its own row: shuffles on the GPU.
# The simulator has no shuffles: there such kernels run one "warp" per block (at most 32
# threads), reduced in shared memory, or a single thread with nothing to reduce.
if SIMULATOR:
    @device_function
    def lanes_max(v):
        """Max of v over the warp's lanes (NaN if any is NaN); every lane gets it."""
        if cuda.blockDim.x == 1:
            return v
        buf = cuda.shared.array(32, float32)
        return block_max(buf, v)

    @device_function
    def lanes_sum(v):
        """Sum of v over the warp's lanes; every lane gets it."""
        if cuda.blockDim.x == 1:
            return v
        buf = cuda.shared.array(32, float32)
        return block_sum(buf, v)
else:
    lanes_max = warp_max
    lanes_sum = warp_sum


@functools.cache
def row_reductions(lanes):
    """(merge_log2(m, s), sum(v)) over a row's `lanes` lanes, for kernels that give each aligned group of `lanes`
    lanes of a warp its own row (a power of two, at most 32; the whole warp takes part): shuffles on the GPU, the
    thread block under the simulator (a row a block there). merge_log2 gives the row's (max, sum of 2**(x - max))
    from its lanes' pairs (log2 units); every lane gets the results."""
    if SIMULATOR:
        row_max, row_sum = lanes_max, lanes_sum
    else:
        row_max, row_sum = shuffle_reductions(lanes)

    @device_function
    def merge_log2(m, s):
        top = row_max(m)
        if m != NEG_INF:   # else s is 0 (and m - top may be NaN)
            s *= exp2f(m - top)
        return top, row_sum(s)

    return merge_log2, row_sum
