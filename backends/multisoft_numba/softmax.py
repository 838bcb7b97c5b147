"""Row softmax / log_softmax, forward and backward.

Three ways to walk a row, all reading in float32 and writing in the row's dtype:
- cached: the row held in registers (CACHE elements per thread): one read of the
  input. A thread block per row, or for short rows a group of threads per row,
  several rows a block (ROW_GROUP_MAX). The forward of 16-bit rows of 32768
  (PREFETCH_FROM) runs as persistent blocks that read their next row while they
  reduce and write the current one.
- split (GPU only, long rows): the row cut into parts (SPLIT_FORWARD, SPLIT_BWD), one block
  per part, each holding its part in registers; the parts exchange
  their statistics through global memory and wait for each other, so the input
  is still read once. Blocks take their (row, part) from a ticket counter in
  the order they start, so a waiting block only waits for blocks that have
  started or will start next: deadlock-free whenever a row's parts can be
  resident together (parts <= half the SMs, see _max_parts).
- looping (the rest, and the simulator, which runs one block at a time): one
  block per row, two reads (online max/sum, then the output), UNROLL loads in
  flight per thread. The second pass walks the row from its end, so it first
  meets what the first pass read last, while that is still in L2.

The cached and split paths hold 16-bit rows in vectors of 2 or more elements as
their raw words (_device.packed_io): two elements per register instead of one
float each, so a block holds twice the bytes.

Kernels are built by the factories below per (element format, vector width, log,
elements per thread, threads per row group), all compile-time constants. Rows are read and written a
vector at a time (_device.strided_io) through one-row views indexed with unsigned
integers, which numba compiles without negative-index wraparound.
"""

import functools
from typing import NamedTuple

import numpy
import torch
from numba import cuda, float32, int32, uint64

from ._device import (FP32, HALF_SHIFT, NEG_INF, block_max, block_online_merge, block_sum, expf, fresh_shift,
                      kahan_add, logf, nan_max, online_add_all, online_merge, packed_io, packed_max,
                      packed_pad, row_groups, row_io, share_shift, strided_io, warp_online_merge, warp_sum,
                      word_layout)
from ._glue import (MAX_THREADS, SIMULATOR, device_function, device_index, kernel, launch, next_pow2, threads_for,
                    vector_views)

# Measured on the H200 (benchmarks/tune/numba.sh); keyed by the element size in bytes where
# float32 and 16-bit rows differ.
# Keyed by the bytes a held element takes in registers: 4 for float32 (and 16-bit rows that
# cannot be read in pairs), 2 for packed 16-bit rows.
CACHE = {4: (32,), 2: (32,)}   # forward: row elements per thread held in registers, fewest first
CACHE_BWD = {4: (16,), 2: (8, 32)}   # backward: elements of y and of dy per thread, fewest first
# The parts of split rows, by held bytes: (threads, elements per thread, blocks a multiprocessor the kernel is
# compiled for), the first choice that cuts the row into at most SPLIT_FEW_PARTS parts, else the first that fits.
# Blocks b > 0: launch bounds (threads, b), a register budget of 65536 / (threads * b) a thread (1: none below
# 255); 0: the 1024-thread bound of the other kernels (64 registers).
# Forward: several blocks per SM, so one's loads overlap another's waiting. Measured on an H200 in session 29
# (tuning/numba-split-budget-round1.txt, numba-split-shape-round1.txt, numba-split-forward-sizes-round1.txt), float32
# 128 x 64 at 5 blocks against 256 x 32 under the 1024-thread bound, two runs: softmax 0.75 -> 0.78-0.80 at 1024x131072
# and 0.75-0.78 -> 0.79-0.81 at 512x262144, log_softmax 0.77-0.82 -> 0.84-0.86 and 0.76-0.80 -> 0.83-0.84, every
# length that splits +0.02-0.08 but 1048576 (the wide parts: level); 4 or 6 blocks, 128 x 32, and holding
# exp(x - part max) (SPLIT_KEEP_EXP) lost. bf16 (held as words): 128 or 512 threads, 32 values, and budgets for 2 or 3
# blocks lost or were mixed (128 threads: +0.04 at 512x262144, -0.01 elsewhere).
SPLIT_FORWARD = {4: ((128, 64, 5),), 2: ((256, 64, 0),)}
# Backward: y and dy per thread, compiled for their block size so that 32 values of each fit in registers. Measured
# on an H200 (tuning/numba-split-bwd-round2.txt) against 256 x 16 float32 values under the 1024-thread bound:
# 0.85 -> 0.89 at 131072 columns (128 threads), 0.77 -> 0.82 at 262144 and 0.59 -> 0.73 at 524288 (256 threads:
# half the parts of 128); 16-bit rows level either way. Budgets (numba-split-shape-round1.txt) for 2 blocks: level;
# for 3-4: float32 log_softmax +0.02 at 131072, float32 at 262144 0.04-0.36 slower.
SPLIT_BWD = {4: ((128, 32, 1), (256, 32, 1)), 2: ((256, 32, 1),)}
SPLIT_FEW_PARTS = 32
UNROLL = 8       # elements per thread per step of the looping kernels
MAX_PARTS = {4: 64, 2: 64}   # most blocks one row is split into
PACK_16BIT = True   # hold 16-bit rows read in pairs as words (_device.packed_io) on the cached and split paths
CACHED_THREADS = 1024   # most threads of a block that holds a whole row
# Rows that take at most ROW_GROUP_MAX threads (by direction, at their CACHE / CACHE_BWD elements each) share
# blocks of ROW_GROUP_BLOCK threads, a group of threads per row (0: a block per row whatever the row): blocks of
# a few threads, at most 32 resident per multiprocessor, left it short of loads in flight. Measured on an H200
# (tuning/short-rows-round1..2.txt), against a block per row: bf16 rows of 256 columns forward 0.39 -> 0.91 of
# copy, backward 0.59 -> 0.97; float32 forward 0.76 -> 0.96; bf16 512 forward 0.74 -> 0.91. Forward rows of
# 1024 (32 threads) measured 0.01 faster as a block each; blocks of 128 or 512 threads level or slower; bf16
# backward rows of 256 and 512 as groups of 8 and 16 threads holding 32 values each 0.97 -> 0.88.
ROW_GROUP_MAX = {"forward": 16, "backward": 32}
ROW_GROUP_BLOCK = 256
# The parts (as SPLIT_FORWARD, SPLIT_BWD) of rows too long for the split choices above (their parts would not all
# be resident), which would otherwise loop, by direction and held bytes. Measured on an H200
# (tuning/few-rows-round1.txt), 64 rows of 1048576, 512 threads against looping: float32 forward 0.53 -> 0.61 of
# copy, backward 0.49 -> 0.58; bf16 backward 0.33 -> 0.68. As a choice for rows that other parts fit, it lost (rows
# of 524288: float32 backward 0.73 -> 0.68, bf16 forward 0.65 -> 0.59).
SPLIT_WIDE = {"forward": {4: (512, 32, 0), 2: (512, 64, 0)}, "backward": {4: (512, 32, 1), 2: (512, 32, 1)}}
# The float32 split softmax forward holds exp(x - part max) between its passes (True) or x, taking the
# exponential again (False): keeping compiled to 64 registers and 60 bytes of spills (sm_90).
SPLIT_KEEP_EXP = False
COUNTER_STRIDE = 32   # int32s from one row's arrival counter to the next (one 128-byte line each)
# Forward rows held as words (by held bytes) of at least PREFETCH_FROM elements, a block each, run as persistent
# blocks, one a multiprocessor, that read their next row before they reduce and write the current one
# (_forward_packed_prefetch): a block that holds a whole row takes the multiprocessor's registers, so its loads and
# its stores would not overlap.
PREFETCH_FROM = {2: 32768}


@device_function
def _normalise(vals, m, s, log):
    """vals (exp(x - m) for softmax, x for log_softmax) -> the outputs, in place."""
    if log:
        log_s = logf(s)
        for k in range(vals.shape[0]):
            vals[k] = (vals[k] - m) - log_s
    else:
        inv_s = float32(1.0) / s
        for k in range(vals.shape[0]):
            vals[k] = vals[k] * inv_s


@device_function
def _exp_sum(vals, m, keep):
    """Sum of exp(vals - m); vals become those exponentials when `keep`."""
    s = float32(0.0)
    for k in range(vals.shape[0]):
        e = expf(vals[k] - m)
        s += e
        if keep:
            vals[k] = e
    return s


@device_function
def _dot(ys, gs, log):
    """The row term of the backward: sum(dy) for log_softmax, sum(y * dy) for softmax."""
    acc = float32(0.0)
    for k in range(gs.shape[0]):
        acc += gs[k] if log else ys[k] * gs[k]
    return acc


@device_function
def _gradient(ys, gs, acc, log):
    """gs -> dx in place: dy - exp(y) * acc (log_softmax) or y * (dy - acc) (softmax)."""
    for k in range(gs.shape[0]):
        gs[k] = gs[k] - expf(ys[k]) * acc if log else ys[k] * (gs[k] - acc)


@functools.cache
def _forward_cached(fmt, width, log, cache, group):
    read_vectors, write_vectors = strided_io(fmt, width, cache // width)
    words = word_layout(fmt, width)[1]
    thread_row, group_max, group_sum = row_groups(group)

    @kernel
    def forward_cached(x, out):
        row, lane, lanes, limit = thread_row(x.shape[0], x.shape[1] // words)
        buf = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(cache, float32)
        read_vectors(x[row], lane, lanes, limit, vals, NEG_INF)
        m = NEG_INF
        for k in range(cache):
            m = nan_max(m, vals[k])
        m = group_max(buf, m)
        s = group_sum(buf, _exp_sum(vals, m, not log))
        _normalise(vals, m, s, log)
        write_vectors(out[row], lane, lanes, limit, vals)

    return forward_cached


@functools.cache
def _forward_looping(fmt, width, log, unroll):
    read_vectors, write_vectors = strided_io(fmt, width, unroll // width)
    words = word_layout(fmt, width)[1]

    @kernel
    def forward_looping(x, out):
        row = uint64(cuda.blockIdx.x)
        x_row = x[row]
        out_row = out[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        step = threads * (unroll // width)
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(unroll, float32)
        m = NEG_INF
        s = float32(0.0)
        for base in range(tid, n_vectors, step):
            read_vectors(x_row, base, threads, n_vectors, vals, NEG_INF)
            m, s = online_add_all(m, s, vals)
        m, s = block_online_merge(buf_m, buf_s, m, s)
        steps = (n_vectors + step - 1) // step
        for back in range(steps):
            base = tid + (steps - 1 - back) * step
            read_vectors(x_row, base, threads, n_vectors, vals, NEG_INF)
            if not log:
                _exp_sum(vals, m, True)
            _normalise(vals, m, s, log)
            write_vectors(out_row, base, threads, n_vectors, vals)

    return forward_looping


@functools.cache
def _backward_cached(fmt, width, log, cache, group):
    read_vectors, write_vectors = strided_io(fmt, width, cache // width)
    words = word_layout(fmt, width)[1]
    thread_row, _, group_sum = row_groups(group)

    @kernel
    def backward_cached(y, dy, dx):
        row, lane, lanes, limit = thread_row(y.shape[0], y.shape[1] // words)
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(cache, float32)
        gs = cuda.local.array(cache, float32)
        read_vectors(y[row], lane, lanes, limit, ys, float32(0.0))
        read_vectors(dy[row], lane, lanes, limit, gs, float32(0.0))
        acc = group_sum(buf, _dot(ys, gs, log))
        _gradient(ys, gs, acc, log)
        write_vectors(dx[row], lane, lanes, limit, gs)

    return backward_cached


@functools.cache
def _backward_looping(fmt, width, log, unroll):
    read_vectors, write_vectors = strided_io(fmt, width, unroll // width)
    words = word_layout(fmt, width)[1]

    @kernel
    def backward_looping(y, dy, dx):
        row = uint64(cuda.blockIdx.x)
        y_row = y[row]
        dy_row = dy[row]
        dx_row = dx[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = y.shape[1] // words
        step = threads * (unroll // width)
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(unroll, float32)
        gs = cuda.local.array(unroll, float32)
        acc = float32(0.0)
        lost = float32(0.0)
        for base in range(tid, n_vectors, step):
            read_vectors(dy_row, base, threads, n_vectors, gs, float32(0.0))
            if not log:
                read_vectors(y_row, base, threads, n_vectors, ys, float32(0.0))
            acc, lost = kahan_add(acc, lost, _dot(ys, gs, log))
        acc = block_sum(buf, acc - lost)
        steps = (n_vectors + step - 1) // step
        for back in range(steps):
            base = tid + (steps - 1 - back) * step
            read_vectors(y_row, base, threads, n_vectors, ys, float32(0.0))
            read_vectors(dy_row, base, threads, n_vectors, gs, float32(0.0))
            _gradient(ys, gs, acc, log)
            write_vectors(dx_row, base, threads, n_vectors, gs)

    return backward_looping


@device_function
def _softmax_value(x, unused, m, inv_s):
    return expf(x - m) * inv_s


@device_function
def _log_softmax_value(x, unused, m, log_s):
    return (x - m) - log_s


@device_function
def _softmax_gradient(y, g, acc, unused):
    return y * (g - acc)


@device_function
def _log_softmax_gradient(y, g, acc, unused):
    return g - expf(y) * acc


@functools.cache
def _packed_writer(fmt, width, cache, formula):
    """write(array, first, step, limit, raw_a, raw_b, shift, p, q): formula(a, b, p, q) of the packed
    elements a of raw_a and b of raw_b (_device.packed_io), written to the same places a vector at a time."""
    _, unpack = packed_io(fmt, width, cache // width)
    _, write = row_io(fmt, width)

    @device_function
    def write_through(array, first, step, limit, raw_a, raw_b, shift, p, q, vec):
        for k in range(cache // width):
            c = first + k * step
            if c < limit:
                for j in range(width):
                    at = k * width + j
                    vec[j] = formula(unpack(raw_a, at, shift), unpack(raw_b, at, shift), p, q)
                write(array, c, vec, 0)

    if SIMULATOR:
        def write_packed(array, first, step, limit, raw_a, raw_b, shift, p, q):
            write_through(array, first, step, limit, raw_a, raw_b, shift, p, q, numpy.empty(width, numpy.float32))
    else:
        @device_function
        def write_packed(array, first, step, limit, raw_a, raw_b, shift, p, q):
            write_through(array, first, step, limit, raw_a, raw_b, shift, p, q, cuda.local.array(width, float32))
    return write_packed


@functools.cache
def _packed_reductions(fmt, width, cache):
    """(row_max(raw), exp_sum(raw, m, shift), dot(ys, gs, log)) over this thread's packed elements: the
    packed twins of the max loop, _exp_sum (without keep) and _dot. row_max compares the words' halves as
    they are (_device.packed_max), dot unpacks with the constant HALF_SHIFT (the first pass), exp_sum with
    the caller's `shift` (see _device.packed_io)."""
    _, unpack = packed_io(fmt, width, cache // width)
    pair_max, word_max = packed_max(fmt)

    @device_function
    def row_max(raw):
        w = raw[0]
        for k in range(1, cache // 2):
            w = pair_max(w, raw[k])
        return word_max(w)

    @device_function
    def exp_sum(raw, m, shift):
        s = float32(0.0)
        for k in range(cache):
            s += expf(unpack(raw, k, shift) - m)
        return s

    @device_function
    def dot(ys, gs, log):
        acc = float32(0.0)
        for k in range(cache):
            g = unpack(gs, k, HALF_SHIFT)
            acc += g if log else unpack(ys, k, HALF_SHIFT) * g
        return acc

    return row_max, exp_sum, dot


@device_function
def _output_parameter(s, log):
    """What the output formula takes besides the max: log(sum) for log_softmax, 1 / sum for softmax."""
    return logf(s) if log else float32(1.0) / s


def _packed_forward_pieces(fmt, width, log, cache):
    """What the forwards of 16-bit rows held as words build on: (read_packed, row_max, exp_sum, write_packed,
    words a vector, words held a thread, the padding word)."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    row_max, exp_sum, _ = _packed_reductions(fmt, width, cache)
    write_packed = _packed_writer(fmt, width, cache, _log_softmax_value if log else _softmax_value)
    return read_packed, row_max, exp_sum, write_packed, word_layout(fmt, width)[1], cache // 2, packed_pad(fmt, NEG_INF)


@functools.cache
def _forward_packed(fmt, width, log, cache, group):
    """forward_cached for 16-bit rows held as words."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = _packed_forward_pieces(fmt, width, log, cache)
    thread_row, group_max, group_sum = row_groups(group)

    @kernel
    def forward_packed(x, out):
        row, lane, lanes, limit = thread_row(x.shape[0], x.shape[1] // words)
        buf = cuda.shared.array(MAX_THREADS, float32)
        slot = cuda.shared.array(1, int32)
        raw = cuda.local.array(held_words, int32)
        share_shift(slot)
        read_packed(x[row], lane, lanes, limit, raw, pad)
        if group:  # no block barrier follows: one before the first fresh_shift
            cuda.syncthreads()
        m = group_max(buf, row_max(raw))
        s = group_sum(buf, exp_sum(raw, m, fresh_shift(slot)))
        write_packed(out[row], lane, lanes, limit, raw, raw, fresh_shift(slot), m, _output_parameter(s, log))

    return forward_packed


@functools.cache
def _forward_packed_prefetch(fmt, width, log, cache):
    """forward_packed with a block a row, as persistent blocks that walk the rows a grid apart and have their next
    row's loads in flight while they reduce and write the current one."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = _packed_forward_pieces(fmt, width, log, cache)

    @kernel
    def forward_packed_prefetch(x, out):
        rows = uint64(x.shape[0])
        limit = x.shape[1] // words
        lane = cuda.threadIdx.x
        lanes = cuda.blockDim.x
        buf = cuda.shared.array(MAX_THREADS, float32)
        slot = cuda.shared.array(1, int32)
        raw = cuda.local.array(held_words, int32)
        upcoming = cuda.local.array(held_words, int32)
        share_shift(slot)
        row = uint64(cuda.blockIdx.x)
        step = uint64(cuda.gridDim.x)
        read_packed(x[row], lane, lanes, limit, upcoming, pad)   # the grid has at most a block a row
        while row < rows:
            for k in range(held_words):
                raw[k] = upcoming[k]
            following = row + step
            if following < rows:
                read_packed(x[following], lane, lanes, limit, upcoming, pad)
            m = block_max(buf, row_max(raw))
            s = block_sum(buf, exp_sum(raw, m, fresh_shift(slot)))
            write_packed(out[row], lane, lanes, limit, raw, raw, fresh_shift(slot), m, _output_parameter(s, log))
            row = following

    return forward_packed_prefetch


@functools.cache
def _backward_packed(fmt, width, log, cache, group):
    """backward_cached for 16-bit rows held as words."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    _, _, dot = _packed_reductions(fmt, width, cache)
    write_packed = _packed_writer(fmt, width, cache, _log_softmax_gradient if log else _softmax_gradient)
    words = word_layout(fmt, width)[1]
    held_words = cache // 2
    thread_row, _, group_sum = row_groups(group)

    @kernel
    def backward_packed(y, dy, dx):
        row, lane, lanes, limit = thread_row(y.shape[0], y.shape[1] // words)
        buf = cuda.shared.array(MAX_THREADS, float32)
        slot = cuda.shared.array(1, int32)
        ys = cuda.local.array(held_words, int32)
        gs = cuda.local.array(held_words, int32)
        share_shift(slot)
        read_packed(y[row], lane, lanes, limit, ys, int32(0))
        read_packed(dy[row], lane, lanes, limit, gs, int32(0))
        if group:  # no block barrier follows: one before the first fresh_shift
            cuda.syncthreads()
        acc = group_sum(buf, dot(ys, gs, log))
        write_packed(dx[row], lane, lanes, limit, ys, gs, fresh_shift(slot), acc, float32(0.0))

    return backward_packed


@device_function
def _take_ticket(sync):
    """This block's start order (sync[0] counts started blocks)."""
    slot = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        slot[0] = cuda.atomic.add(sync, 0, 1)
    cuda.syncthreads()
    return slot[0]


@device_function
def _publish_and_wait(sync, row, parts):
    """Count this part of `row` as published and wait for all `parts` (the row's counter is
    sync[(row + 1) * COUNTER_STRIDE], alone on its 128-byte line)."""
    if cuda.threadIdx.x == 0:
        counter = (row + 1) * COUNTER_STRIDE
        cuda.threadfence()
        cuda.atomic.add(sync, counter, 1)
        while cuda.atomic.add(sync, counter, 0) < parts:
            pass
        cuda.threadfence()
    cuda.syncthreads()


@device_function
def _merged_statistics(stats, at, parts):
    """The row's (max, sum of exp) from its parts' stats[at:at + parts] (maxima) and
    stats[at + parts:at + 2 * parts] (sums): each warp's lanes load parts side by side."""
    m = NEG_INF
    s = float32(0.0)
    for p in range(cuda.threadIdx.x % 32, parts, 32):
        m, s = online_merge(m, s, cuda.ldcg(stats, at + p), cuda.ldcg(stats, at + parts + p))
    return warp_online_merge(m, s)


@device_function
def _summed_statistics(stats, at, parts):
    """The sum of stats[at:at + parts]: each warp's lanes load parts side by side."""
    total = float32(0.0)
    for p in range(cuda.threadIdx.x % 32, parts, 32):
        total += cuda.ldcg(stats, at + p)
    return warp_sum(total)


@functools.cache
def _forward_split(fmt, width, log, cache, keep, bound):
    """keep (softmax only): hold exp(x - part max) between the passes and rescale it, one exponential
    per element; otherwise hold x and take the exponential again (see SPLIT_KEEP_EXP)."""
    read_vectors, write_vectors = strided_io(fmt, width, cache // width)
    words = word_layout(fmt, width)[1]

    @kernel(bound=bound)
    def forward_split(x, out, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        buf = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(cache, float32)
        ticket = _take_ticket(sync)
        row = ticket // parts
        part = ticket % parts
        first = part * (cache // width) * threads + tid
        read_vectors(x[uint64(row)], first, threads, n_vectors, vals, NEG_INF)
        m = NEG_INF
        for k in range(cache):
            m = nan_max(m, vals[k])
        part_m = block_max(buf, m)
        s = float32(0.0)
        if part_m != NEG_INF:
            s = _exp_sum(vals, part_m, keep)
        elif keep:
            for k in range(cache):
                vals[k] = float32(0.0)
        s = block_sum(buf, s)
        at = row * 2 * parts + part
        if tid == 0:
            stats[at] = part_m
            stats[at + parts] = s
        _publish_and_wait(sync, row, parts)
        m, s = _merged_statistics(stats, row * 2 * parts, parts)
        if log:
            _normalise(vals, m, s, True)
        elif keep:
            scale = expf(part_m - m) / s
            for k in range(cache):
                vals[k] = vals[k] * scale
        else:
            _exp_sum(vals, m, True)
            _normalise(vals, m, s, False)
        write_vectors(out[uint64(row)], first, threads, n_vectors, vals)

    return forward_split


@functools.cache
def _backward_split(fmt, width, log, cache, bound):
    read_vectors, write_vectors = strided_io(fmt, width, cache // width)
    words = word_layout(fmt, width)[1]

    @kernel(bound=bound)
    def backward_split(y, dy, dx, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = y.shape[1] // words
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(cache, float32)
        gs = cuda.local.array(cache, float32)
        ticket = _take_ticket(sync)
        row = ticket // parts
        urow = uint64(row)
        part = ticket % parts
        first = part * (cache // width) * threads + tid
        read_vectors(y[urow], first, threads, n_vectors, ys, float32(0.0))
        read_vectors(dy[urow], first, threads, n_vectors, gs, float32(0.0))
        acc = block_sum(buf, _dot(ys, gs, log))
        if tid == 0:
            stats[row * parts + part] = acc
        _publish_and_wait(sync, row, parts)
        acc = _summed_statistics(stats, row * parts, parts)
        _gradient(ys, gs, acc, log)
        write_vectors(dx[urow], first, threads, n_vectors, gs)

    return backward_split


@functools.cache
def _forward_split_packed(fmt, width, log, cache, bound):
    """forward_split for 16-bit rows held as words."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = _packed_forward_pieces(fmt, width, log, cache)

    @kernel(bound=bound)
    def forward_split_packed(x, out, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        buf = cuda.shared.array(MAX_THREADS, float32)
        slot = cuda.shared.array(1, int32)
        raw = cuda.local.array(held_words, int32)
        share_shift(slot)
        ticket = _take_ticket(sync)
        row = ticket // parts
        part = ticket % parts
        first = part * (cache // width) * threads + tid
        read_packed(x[uint64(row)], first, threads, n_vectors, raw, pad)
        part_m = block_max(buf, row_max(raw))
        s = float32(0.0)
        if part_m != NEG_INF:
            s = exp_sum(raw, part_m, fresh_shift(slot))
        s = block_sum(buf, s)
        at = row * 2 * parts + part
        if tid == 0:
            stats[at] = part_m
            stats[at + parts] = s
        _publish_and_wait(sync, row, parts)
        m, s = _merged_statistics(stats, row * 2 * parts, parts)
        write_packed(out[uint64(row)], first, threads, n_vectors, raw, raw, fresh_shift(slot), m,
                     _output_parameter(s, log))

    return forward_split_packed


@functools.cache
def _backward_split_packed(fmt, width, log, cache, bound):
    """backward_split for 16-bit rows held as words."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    _, _, dot = _packed_reductions(fmt, width, cache)
    write_packed = _packed_writer(fmt, width, cache, _log_softmax_gradient if log else _softmax_gradient)
    words = word_layout(fmt, width)[1]
    held_words = cache // 2

    @kernel(bound=bound)
    def backward_split_packed(y, dy, dx, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = y.shape[1] // words
        buf = cuda.shared.array(MAX_THREADS, float32)
        slot = cuda.shared.array(1, int32)
        ys = cuda.local.array(held_words, int32)
        gs = cuda.local.array(held_words, int32)
        share_shift(slot)
        ticket = _take_ticket(sync)
        row = ticket // parts
        urow = uint64(row)
        part = ticket % parts
        first = part * (cache // width) * threads + tid
        read_packed(y[urow], first, threads, n_vectors, ys, int32(0))
        read_packed(dy[urow], first, threads, n_vectors, gs, int32(0))
        acc = block_sum(buf, dot(ys, gs, log))
        if tid == 0:
            stats[row * parts + part] = acc
        _publish_and_wait(sync, row, parts)
        acc = _summed_statistics(stats, row * parts, parts)
        write_packed(dx[urow], first, threads, n_vectors, ys, gs, fresh_shift(slot), acc, float32(0.0))

    return backward_split_packed


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _max_parts(index: int, held: int) -> int:
    """Most parts a row may be split into on GPU `index`: few enough that they are always
    resident together (half the SMs, one block each), and at most MAX_PARTS[held]."""
    return min(MAX_PARTS[held], _multiprocessors(index) // 2)


class Plan(NamedTuple):
    """How a launch walks its rows: `path` ('cached' | 'prefetch' | 'split' | 'looping') with blocks of `threads`
    threads, each holding `cache` elements per thread (split, looping: the looping kernels' width is UNROLL), a row
    cut into `parts` blocks (split), its kernel compiled for `blocks` of them a multiprocessor (split; see
    SPLIT_FORWARD); `group` > 0 (cached only): a row per `group` threads, several rows a block; prefetch (forward,
    16-bit rows held as words): cached with a block a row, as persistent blocks."""

    path: str
    threads: int
    parts: int
    cache: int
    group: int = 0
    blocks: int = 0

    @property
    def bound(self):
        """The split kernel's launch bounds (None: the 1024-thread bound)."""
        return (self.threads, self.blocks) if self.blocks else None


def _plan(n: int, caches, splits, held: int, device=None, row_group_max: int = 0, wide=None) -> Plan:
    """The Plan for rows of n elements that take `held` bytes each in registers; `caches`: the elements
    per thread that a block holding the whole row may take, fewest first, each as a group of at most
    `row_group_max` threads sharing a block with other rows, else as a block; `splits`: the
    (threads, elements per thread, blocks a multiprocessor) of a block holding a part of a row, the first that
    makes at most SPLIT_FEW_PARTS parts, else the first whose parts can all be resident, else `wide` (the same),
    if its parts can."""
    for cache in caches:
        needed = next_pow2(-(-n // cache))
        if needed <= min(row_group_max, MAX_THREADS):
            return Plan("cached", min(ROW_GROUP_BLOCK, MAX_THREADS), 1, cache, needed)
        threads = min(threads_for(n, cache), CACHED_THREADS)
        if n <= threads * cache:
            return Plan("cached", threads, 1, cache)
    if not SIMULATOR and device is not None and device.type == "cuda":
        index = device_index(device)

        def fitting(choices):
            plans = [Plan("split", threads, -(-n // (threads * cache)), cache, 0, blocks)
                     for threads, cache, blocks in choices]
            return [p for p in plans if p.parts <= _max_parts(index, held)]

        regular = fitting(splits)
        if regular:
            return next((p for p in regular if p.parts <= SPLIT_FEW_PARTS), regular[0])
        fallback = fitting((wide,)) if wide else []
        if fallback:
            return fallback[0]
    return Plan("looping", threads_for(n, 8 * UNROLL), 1, splits[0][1])


def _forward_plan(n: int, held: int, device) -> Plan:
    plan = _plan(n, CACHE[held], SPLIT_FORWARD[held], held, device, ROW_GROUP_MAX["forward"],
                 SPLIT_WIDE["forward"][held])
    if plan.path == "cached" and not plan.group and held == 2 and n >= PREFETCH_FROM.get(held, float("inf")):
        return plan._replace(path="prefetch")
    return plan


def _persistent_blocks(rows: int, device) -> int:
    """Blocks of a persistent launch: one a multiprocessor (the simulator: two, each walking several rows)."""
    if SIMULATOR or device.type != "cuda":
        return min(rows, 2)
    return min(rows, _multiprocessors(device_index(device)))


def _cached_blocks(rows: int, threads: int, group: int) -> int:
    """Blocks of the cached kernels: a row each, or threads // group rows each."""
    return -(-rows // (threads // group)) if group else rows


def _held_bytes(fmt, width) -> int:
    """Bytes an element takes in registers: 2 for 16-bit rows read in pairs (held as words), else 4."""
    return 2 if PACK_16BIT and fmt != FP32 and width >= 2 else 4


def _split_buffers(rows: int, parts: int, values_per_part: int, device):
    """(statistics, zeroed counters: started blocks, then published parts per row)."""
    stats = torch.empty(rows * parts * values_per_part, dtype=torch.float32, device=device)
    sync = torch.zeros((rows + 1) * COUNTER_STRIDE, dtype=torch.int32, device=device)
    return stats, sync


def forward_split_kernel(fmt, width, log: bool, held: int, plan: Plan):
    """The forward split kernel of a split Plan for rows that take `held` bytes an element in registers."""
    if held == 2:
        return _forward_split_packed(fmt, width, log, plan.cache, plan.bound)
    return _forward_split(fmt, width, log, plan.cache, not log and SPLIT_KEEP_EXP, plan.bound)


def backward_split_kernel(fmt, width, log: bool, held: int, plan: Plan):
    """The backward split kernel of a split Plan for rows that take `held` bytes an element in registers."""
    build = _backward_split_packed if held == 2 else _backward_split
    return build(fmt, width, log, plan.cache, plan.bound)


def forward(x, out, log: bool, plan=None) -> None:
    rows, n = x.shape
    fmt, width, words = vector_views((x, out))
    held = _held_bytes(fmt, width)
    plan = Plan(*plan) if plan else _forward_plan(n, held, x.device)
    path, threads, parts, cache, group, _ = plan
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 2, x.device)
        launch(forward_split_kernel(fmt, width, log, held, plan), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        build = _forward_packed if held == 2 else _forward_cached
        launch(build(fmt, width, log, cache, group), _cached_blocks(rows, threads, group), threads, words)
    elif path == "prefetch":
        launch(_forward_packed_prefetch(fmt, width, log, cache), _persistent_blocks(rows, x.device), threads, words)
    else:
        launch(_forward_looping(fmt, width, log, UNROLL), rows, threads, words)


def backward(y, dy, dx, log: bool, plan=None) -> None:
    rows, n = y.shape
    fmt, width, words = vector_views((y, dy, dx))
    held = _held_bytes(fmt, width)
    plan = Plan(*plan) if plan else _plan(n, CACHE_BWD[held], SPLIT_BWD[held], held, y.device,
                                          ROW_GROUP_MAX["backward"], SPLIT_WIDE["backward"][held])
    path, threads, parts, cache, group, _ = plan
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 1, y.device)
        launch(backward_split_kernel(fmt, width, log, held, plan), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        build = _backward_packed if held == 2 else _backward_cached
        launch(build(fmt, width, log, cache, group), _cached_blocks(rows, threads, group), threads, words)
    else:
        launch(_backward_looping(fmt, width, log, UNROLL), rows, threads, words)
