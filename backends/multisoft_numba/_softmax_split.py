"""Softmax kernels of split rows (GPU only, long rows): a row cut into parts, one block a part, each holding its part
in registers (as floats or, for 16-bit rows read in pairs, as their words). The parts exchange their statistics
through global memory and wait for each other, so the input is still read once. Blocks take their (row, part) from
a ticket counter in the order they start, so a waiting block only waits for blocks that have started or will start
next: deadlock-free whenever a row's parts can be resident together (softmax._max_parts).
"""

import functools

from numba import cuda, float32, int32, uint64

from ._device import (NEG_INF, block_max, block_sum, fresh_shift, nan_max, online_merge, packed_io, share_shift,
                      strided_io, warp_online_merge, warp_sum, word_layout)
from ._launch import MAX_THREADS, device_function, kernel
from ._softmax_rows import (apply_gradient, backward_dot, log_softmax_gradient, normalise, output_parameter,
                            packed_forward_pieces, packed_reductions, packed_writer, softmax_gradient, sum_exp)
from ._tuning import COUNTER_STRIDE


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
def forward_split_kernel(fmt, width, log, cache, bound):
    """The forward of a part of a row, `cache` elements a thread, compiled for launch bounds `bound` (None: the
    1024-thread bound). The part holds x between its passes and takes the exponential again in the second."""
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
            s = sum_exp(vals, part_m, False)
        s = block_sum(buf, s)
        at = row * 2 * parts + part
        if tid == 0:
            stats[at] = part_m
            stats[at + parts] = s
        _publish_and_wait(sync, row, parts)
        m, s = _merged_statistics(stats, row * 2 * parts, parts)
        if log:
            normalise(vals, m, s, True)
        else:
            sum_exp(vals, m, True)
            normalise(vals, m, s, False)
        write_vectors(out[uint64(row)], first, threads, n_vectors, vals)

    return forward_split


@functools.cache
def backward_split_kernel(fmt, width, log, cache, bound):
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
        acc = block_sum(buf, backward_dot(ys, gs, log))
        if tid == 0:
            stats[row * parts + part] = acc
        _publish_and_wait(sync, row, parts)
        acc = _summed_statistics(stats, row * parts, parts)
        apply_gradient(ys, gs, acc, log)
        write_vectors(dx[urow], first, threads, n_vectors, gs)

    return backward_split


@functools.cache
def forward_split_packed_kernel(fmt, width, log, cache, bound):
    """forward_split for 16-bit rows held as words."""
    read_packed, row_max, exp_sum, write_packed, words, held_words, pad = packed_forward_pieces(fmt, width, log, cache)

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
                     output_parameter(s, log))

    return forward_split_packed


@functools.cache
def backward_split_packed_kernel(fmt, width, log, cache, bound):
    """backward_split for 16-bit rows held as words."""
    read_packed, _ = packed_io(fmt, width, cache // width)
    _, _, dot = packed_reductions(fmt, width, cache)
    write_packed = packed_writer(fmt, width, cache, log_softmax_gradient if log else softmax_gradient)
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
