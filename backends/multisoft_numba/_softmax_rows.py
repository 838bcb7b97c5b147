"""Softmax kernels that give each row to one block or thread group: cached (the row held in registers, as floats or,
for 16-bit rows read in pairs, as their words), prefetch (cached as persistent blocks) and looping (two reads);
and the per-thread pieces that the split kernels (_softmax_split) share with them.

Kernels are built per (element format, vector width, log, elements per thread, threads per row group), all
compile-time constants. Rows are read and written a vector at a time (_device.strided_io) through one-row views
indexed with unsigned integers, which numba compiles without negative-index wraparound.
"""

import functools

import numpy
from numba import cuda, float32, int32, uint64

from ._device import (HALF_SHIFT, NEG_INF, block_max, block_online_merge, block_sum, expf, fresh_shift, kahan_add,
                      logf, nan_max, online_add_all, packed_io, packed_max, packed_pad, row_groups, row_io,
                      share_shift, strided_io, word_layout)
from ._launch import MAX_THREADS, SIMULATOR, device_function, kernel


@device_function
def normalise(vals, m, s, log):
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
def sum_exp(vals, m, keep):
    """Sum of exp(vals - m); vals become those exponentials when `keep`."""
    s = float32(0.0)
    for k in range(vals.shape[0]):
        e = expf(vals[k] - m)
        s += e
        if keep:
            vals[k] = e
    return s


@device_function
def backward_dot(ys, gs, log):
    """The row term of the backward: sum(dy) for log_softmax, sum(y * dy) for softmax."""
    acc = float32(0.0)
    for k in range(gs.shape[0]):
        acc += gs[k] if log else ys[k] * gs[k]
    return acc


@device_function
def apply_gradient(ys, gs, acc, log):
    """gs -> dx in place: dy - exp(y) * acc (log_softmax) or y * (dy - acc) (softmax)."""
    for k in range(gs.shape[0]):
        gs[k] = gs[k] - expf(ys[k]) * acc if log else ys[k] * (gs[k] - acc)


@functools.cache
def forward_cached_kernel(fmt, width, log, cache, group):
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
        s = group_sum(buf, sum_exp(vals, m, not log))
        normalise(vals, m, s, log)
        write_vectors(out[row], lane, lanes, limit, vals)

    return forward_cached


@functools.cache
def forward_looping_kernel(fmt, width, log, unroll):
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
                sum_exp(vals, m, True)
            normalise(vals, m, s, log)
            write_vectors(out_row, base, threads, n_vectors, vals)

    return forward_looping


@functools.cache
def backward_cached_kernel(fmt, width, log, cache, group):
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
        acc = group_sum(buf, backward_dot(ys, gs, log))
        apply_gradient(ys, gs, acc, log)
        write_vectors(dx[row], lane, lanes, limit, gs)

    return backward_cached


@functools.cache
def backward_looping_kernel(fmt, width, log, unroll):
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
            acc, lost = kahan_add(acc, lost, backward_dot(ys, gs, log))
        acc = block_sum(buf, acc - lost)
        steps = (n_vectors + step - 1) // step
        for back in range(steps):
            base = tid + (steps - 1 - back) * step
            read_vectors(y_row, base, threads, n_vectors, ys, float32(0.0))
            read_vectors(dy_row, base, threads, n_vectors, gs, float32(0.0))
            apply_gradient(ys, gs, acc, log)
            write_vectors(dx_row, base, threads, n_vectors, gs)

    return backward_looping


@device_function
def _softmax_value(x, unused, m, inv_s):
    return expf(x - m) * inv_s


@device_function
def _log_softmax_value(x, unused, m, log_s):
    return (x - m) - log_s


@device_function
def softmax_gradient(y, g, acc, unused):
    return y * (g - acc)


@device_function
def log_softmax_gradient(y, g, acc, unused):
    return g - expf(y) * acc


@functools.cache
def packed_writer(fmt, width, cache, formula):
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
def packed_reductions(fmt, width, cache):
    """(row_max(raw), exp_sum(raw, m, shift), dot(ys, gs, log)) over this thread's packed elements: the
    packed twins of the max loop, sum_exp (without keep) and backward_dot. row_max compares the words' halves as
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
def output_parameter(s, log):
    """What the output formula takes besides the max: log(sum) for log_softmax, 1 / sum for softmax."""
    return logf(s) if log else float32(1.0) / s


def packed_forward_pieces(fmt, width, log, cache):
    """What the forwards of 16-bit rows held as words build on: (read_packed, row_max, exp_sum, write_packed,
    words a vector, words held a thread, the padding word)."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    row_max, exp_sum, _ = packed_reductions(fmt, width, cache)
    write_packed = packed_writer(fmt, width, cache, _log_softmax_value if log else _softmax_value)
    return read_packed, row_max, exp_sum, write_packed, word_layout(fmt, width)[1], cache // 2, packed_pad(fmt, NEG_INF)


@functools.cache
def forward_packed_kernel(fmt, width, log, cache, group):
    """forward_cached for 16-bit rows held as words."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = packed_forward_pieces(fmt, width, log, cache)
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
        write_packed(out[row], lane, lanes, limit, raw, raw, fresh_shift(slot), m, output_parameter(s, log))

    return forward_packed


@functools.cache
def forward_prefetch_kernel(fmt, width, log, cache):
    """forward_packed with a block a row, as persistent blocks that walk the rows a grid apart and have their next
    row's loads in flight while they reduce and write the current one."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = packed_forward_pieces(fmt, width, log, cache)

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
            write_packed(out[row], lane, lanes, limit, raw, raw, fresh_shift(slot), m, output_parameter(s, log))
            row = following

    return forward_packed_prefetch


@functools.cache
def backward_packed_kernel(fmt, width, log, cache, group):
    """backward_cached for 16-bit rows held as words."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    _, _, dot = packed_reductions(fmt, width, cache)
    write_packed = packed_writer(fmt, width, cache, log_softmax_gradient if log else softmax_gradient)
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
