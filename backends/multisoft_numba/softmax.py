"""Row softmax / log_softmax, forward and backward.

Three ways to walk a row, all reading in float32 and writing in the row's dtype:
- cached: one thread block per row, the row held in registers (CACHE elements
  per thread): one read of the input.
- split (GPU only, long rows): the row cut into parts of CACHE * SPLIT_THREADS elements,
  one block per part, each holding its part in registers; the parts exchange
  their statistics through global memory and wait for each other, so the input
  is still read once. Blocks take their (row, part) from a ticket counter in
  the order they start, so a waiting block only waits for blocks that have
  started or will start next: deadlock-free whenever a row's parts can be
  resident together (parts <= half the SMs, see _max_parts).
- looping (the rest, and the simulator, which runs one block at a time): one
  block per row, two reads (online max/sum, then the output), UNROLL loads in
  flight per thread.

Kernels are built by the factories below per (codec kind, log, elements per
thread), all compile-time constants. Rows are read and written in words
(_device.codec) through one-row views indexed with unsigned integers, which
numba compiles without negative-index wraparound.
"""

import functools

import numpy
import torch
from numba import cuda, float32, int32, uint64

from ._device import (NEG_INF, block_max, block_online_merge, block_sum, codec, expf, kahan_add, logf, nan_max,
                      online_add_all, online_merge)
from ._glue import MAX_THREADS, SIMULATOR, device_function, kernel, launch, threads_for, word_views

CACHE = 32       # forward: row elements per thread held in registers (rows up to 1024 * CACHE)
CACHE_BWD = 16   # backward: elements of y and of dy per thread (the plan aims at these counts)
UNROLL = 8       # elements per thread per step of the looping kernels
MAX_PARTS = 4    # most blocks one row is split into; longer rows loop (H200: faster beyond 4 parts)
SPLIT_THREADS = 512   # several blocks per SM, so one's loads overlap another's waiting
BF16_PAIRS = True     # bfloat16 rows of even length read and written two elements per access


@functools.cache
def _forward_cached(kind, log, cache):
    per, unpack, pack = codec(kind)
    words = cache // per

    @kernel
    def forward_cached(x, out):
        row = uint64(cuda.blockIdx.x)
        x_row = x[row]
        out_row = out[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = x.shape[1]
        buf = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(cache, float32)
        for k in range(words):
            c = tid + k * threads
            if c < n:
                got = unpack(x_row[uint64(c)])
                for j in range(per):
                    vals[k * per + j] = got[j]
            else:
                for j in range(per):
                    vals[k * per + j] = NEG_INF
        m = NEG_INF
        for k in range(cache):
            m = nan_max(m, vals[k])
        m = block_max(buf, m)
        s = float32(0.0)
        for k in range(cache):
            e = expf(vals[k] - m)
            s += e
            if not log:
                vals[k] = e
        s = block_sum(buf, s)
        log_s = logf(s)
        inv_s = float32(1.0) / s
        for k in range(words):
            c = tid + k * threads
            if c < n:
                first = vals[k * per]
                second = vals[k * per + per - 1]
                if log:
                    out_row[uint64(c)] = pack((first - m) - log_s, (second - m) - log_s)
                else:
                    out_row[uint64(c)] = pack(first * inv_s, second * inv_s)

    return forward_cached


@functools.cache
def _forward_looping(kind, log, unroll):
    per, unpack, pack = codec(kind)
    words = unroll // per

    @kernel
    def forward_looping(x, out):
        row = uint64(cuda.blockIdx.x)
        x_row = x[row]
        out_row = out[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = x.shape[1]
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(unroll, float32)
        m = NEG_INF
        s = float32(0.0)
        for base in range(tid, n, threads * words):
            for k in range(words):
                c = base + k * threads
                if c < n:
                    got = unpack(x_row[uint64(c)])
                    for j in range(per):
                        vals[k * per + j] = got[j]
                else:
                    for j in range(per):
                        vals[k * per + j] = NEG_INF
            m, s = online_add_all(m, s, vals)
        m, s = block_online_merge(buf_m, buf_s, m, s)
        log_s = logf(s)
        inv_s = float32(1.0) / s
        for base in range(tid, n, threads * words):
            for k in range(words):
                c = base + k * threads
                if c < n:
                    got = unpack(x_row[uint64(c)])
                    for j in range(per):
                        vals[k * per + j] = got[j]
            for k in range(words):
                c = base + k * threads
                if c < n:
                    first = vals[k * per]
                    second = vals[k * per + per - 1]
                    if log:
                        out_row[uint64(c)] = pack((first - m) - log_s, (second - m) - log_s)
                    else:
                        out_row[uint64(c)] = pack(expf(first - m) * inv_s, expf(second - m) * inv_s)

    return forward_looping


@functools.cache
def _backward_cached(kind, log, cache):
    per, unpack, pack = codec(kind)
    words = cache // per

    @kernel
    def backward_cached(y, dy, dx):
        row = uint64(cuda.blockIdx.x)
        y_row = y[row]
        dy_row = dy[row]
        dx_row = dx[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = y.shape[1]
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(cache, float32)
        gs = cuda.local.array(cache, float32)
        for k in range(words):
            c = tid + k * threads
            if c < n:
                got_y = unpack(y_row[uint64(c)])
                got_g = unpack(dy_row[uint64(c)])
                for j in range(per):
                    ys[k * per + j] = got_y[j]
                    gs[k * per + j] = got_g[j]
            else:
                for j in range(per):
                    ys[k * per + j] = float32(0.0)
                    gs[k * per + j] = float32(0.0)
        acc = float32(0.0)
        for k in range(cache):
            acc += gs[k] if log else ys[k] * gs[k]
        acc = block_sum(buf, acc)
        for k in range(words):
            c = tid + k * threads
            if c < n:
                i = k * per
                last = i + per - 1
                if log:
                    dx_row[uint64(c)] = pack(gs[i] - expf(ys[i]) * acc, gs[last] - expf(ys[last]) * acc)
                else:
                    dx_row[uint64(c)] = pack(ys[i] * (gs[i] - acc), ys[last] * (gs[last] - acc))

    return backward_cached


@functools.cache
def _backward_looping(kind, log, unroll):
    per, unpack, pack = codec(kind)
    words = unroll // per

    @kernel
    def backward_looping(y, dy, dx):
        row = uint64(cuda.blockIdx.x)
        y_row = y[row]
        dy_row = dy[row]
        dx_row = dx[row]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = y.shape[1]
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(unroll, float32)
        gs = cuda.local.array(unroll, float32)
        acc = float32(0.0)
        lost = float32(0.0)
        for base in range(tid, n, threads * words):
            for k in range(words):
                c = base + k * threads
                if c < n:
                    got_g = unpack(dy_row[uint64(c)])
                    for j in range(per):
                        gs[k * per + j] = got_g[j]
                    if not log:
                        got_y = unpack(y_row[uint64(c)])
                        for j in range(per):
                            ys[k * per + j] = got_y[j]
                else:
                    for j in range(per):
                        ys[k * per + j] = float32(0.0)
                        gs[k * per + j] = float32(0.0)
            for k in range(unroll):
                acc, lost = kahan_add(acc, lost, gs[k] if log else ys[k] * gs[k])
        acc = block_sum(buf, acc - lost)
        for base in range(tid, n, threads * words):
            for k in range(words):
                c = base + k * threads
                if c < n:
                    got_y = unpack(y_row[uint64(c)])
                    got_g = unpack(dy_row[uint64(c)])
                    for j in range(per):
                        ys[k * per + j] = got_y[j]
                        gs[k * per + j] = got_g[j]
            for k in range(words):
                c = base + k * threads
                if c < n:
                    i = k * per
                    last = i + per - 1
                    if log:
                        dx_row[uint64(c)] = pack(gs[i] - expf(ys[i]) * acc, gs[last] - expf(ys[last]) * acc)
                    else:
                        dx_row[uint64(c)] = pack(ys[i] * (gs[i] - acc), ys[last] * (gs[last] - acc))

    return backward_looping


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
    """Count this part of `row` as published (sync[1 + row]) and wait for all `parts`."""
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        cuda.atomic.add(sync, row + 1, 1)
        while cuda.atomic.add(sync, row + 1, 0) < parts:
            pass
        cuda.threadfence()
    cuda.syncthreads()


@functools.cache
def _forward_split(kind, log, cache):
    per, unpack, pack = codec(kind)
    words = cache // per

    @kernel
    def forward_split(x, out, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = x.shape[1]
        buf = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(cache, float32)
        ticket = _take_ticket(sync)
        row = ticket // parts
        urow = uint64(row)
        x_row = x[urow]
        out_row = out[urow]
        part = ticket % parts
        start = part * words * threads + tid
        for k in range(words):
            c = start + k * threads
            if c < n:
                got = unpack(x_row[uint64(c)])
                for j in range(per):
                    vals[k * per + j] = got[j]
            else:
                for j in range(per):
                    vals[k * per + j] = NEG_INF
        m = NEG_INF
        for k in range(cache):
            m = nan_max(m, vals[k])
        part_m = block_max(buf, m)
        s = float32(0.0)
        if part_m != NEG_INF:
            for k in range(cache):
                e = expf(vals[k] - part_m)
                s += e
                if not log:
                    vals[k] = e   # softmax keeps exp(x - part_m), rescaled below
        elif not log:
            for k in range(cache):
                vals[k] = float32(0.0)
        s = block_sum(buf, s)
        at = row * 2 * parts + part
        if tid == 0:
            stats[at] = part_m
            stats[at + parts] = s
        _publish_and_wait(sync, row, parts)
        m = NEG_INF
        s = float32(0.0)
        for p in range(parts):
            m, s = online_merge(m, s, cuda.ldcg(stats, row * 2 * parts + p),
                                cuda.ldcg(stats, row * 2 * parts + parts + p))
        log_s = logf(s)
        scale = expf(part_m - m) / s
        for k in range(words):
            c = start + k * threads
            if c < n:
                first = vals[k * per]
                second = vals[k * per + per - 1]
                if log:
                    out_row[uint64(c)] = pack((first - m) - log_s, (second - m) - log_s)
                else:
                    out_row[uint64(c)] = pack(first * scale, second * scale)

    return forward_split


@functools.cache
def _backward_split(kind, log, cache):
    per, unpack, pack = codec(kind)
    words = cache // per

    @kernel
    def backward_split(y, dy, dx, stats, sync, parts):
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n = y.shape[1]
        buf = cuda.shared.array(MAX_THREADS, float32)
        ys = cuda.local.array(cache, float32)
        gs = cuda.local.array(cache, float32)
        ticket = _take_ticket(sync)
        row = ticket // parts
        urow = uint64(row)
        y_row = y[urow]
        dy_row = dy[urow]
        dx_row = dx[urow]
        part = ticket % parts
        start = part * words * threads + tid
        for k in range(words):
            c = start + k * threads
            if c < n:
                got_y = unpack(y_row[uint64(c)])
                got_g = unpack(dy_row[uint64(c)])
                for j in range(per):
                    ys[k * per + j] = got_y[j]
                    gs[k * per + j] = got_g[j]
            else:
                for j in range(per):
                    ys[k * per + j] = float32(0.0)
                    gs[k * per + j] = float32(0.0)
        acc = float32(0.0)
        for k in range(cache):
            acc += gs[k] if log else ys[k] * gs[k]
        acc = block_sum(buf, acc)
        if tid == 0:
            stats[row * parts + part] = acc
        _publish_and_wait(sync, row, parts)
        acc = float32(0.0)
        for p in range(parts):
            acc += cuda.ldcg(stats, row * parts + p)
        for k in range(words):
            c = start + k * threads
            if c < n:
                i = k * per
                last = i + per - 1
                if log:
                    dx_row[uint64(c)] = pack(gs[i] - expf(ys[i]) * acc, gs[last] - expf(ys[last]) * acc)
                else:
                    dx_row[uint64(c)] = pack(ys[i] * (gs[i] - acc), ys[last] * (gs[last] - acc))

    return backward_split


@functools.lru_cache(maxsize=None)
def _max_parts(device_index: int) -> int:
    """Most parts a row may be split into on this GPU: few enough that they are always
    resident together (half the SMs, one block each), and at most MAX_PARTS."""
    return min(MAX_PARTS, torch.cuda.get_device_properties(device_index).multi_processor_count // 2)


def _plan(n: int, cache: int, device=None):
    """('cached' | 'split' | 'looping', threads per block, parts per row) for rows of n
    elements and `cache` elements held per thread."""
    threads = threads_for(n, cache)
    if n <= threads * cache:
        return "cached", threads, 1
    parts = -(-n // (SPLIT_THREADS * cache))
    if not SIMULATOR and device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if parts <= _max_parts(index):
            return "split", SPLIT_THREADS, parts
    return "looping", threads_for(n, 8 * UNROLL), 1


def _split_buffers(rows: int, parts: int, values_per_part: int, device):
    """(statistics, zeroed counters: started blocks, then published parts per row)."""
    stats = torch.empty(rows * parts * values_per_part, dtype=torch.float32, device=device)
    sync = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    return stats, sync


def forward(x, out, log: bool, plan=None) -> None:
    rows, n = x.shape
    path, threads, parts = plan or _plan(n, CACHE, x.device)
    kind, words = word_views((x, out), BF16_PAIRS)
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 2, x.device)
        launch(_forward_split(kind, log, CACHE), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        launch(_forward_cached(kind, log, CACHE), rows, threads, words)
    else:
        launch(_forward_looping(kind, log, UNROLL), rows, threads, words)


def backward(y, dy, dx, log: bool, plan=None) -> None:
    rows, n = y.shape
    path, threads, parts = plan or _plan(n, CACHE_BWD, y.device)
    kind, words = word_views((y, dy, dx), BF16_PAIRS)
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 1, y.device)
        launch(_backward_split(kind, log, CACHE_BWD), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        launch(_backward_cached(kind, log, CACHE_BWD), rows, threads, words)
    else:
        launch(_backward_looping(kind, log, UNROLL), rows, threads, words)
