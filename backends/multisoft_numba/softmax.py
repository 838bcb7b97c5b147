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
"""

import functools

import numpy
import torch
from numba import cuda, float32, int32

from ._device import (NEG_INF, block_max, block_online_merge, block_sum, expf, kahan_add, load, logf, nan_max,
                      online_add_all, online_merge, store)
from ._glue import MAX_THREADS, SIMULATOR, device_function, is_bf16, kernel, launch, threads_for

CACHE = 16       # forward: row elements per thread held in registers
CACHE_BWD = 8    # backward: elements of y and of dy per thread
UNROLL = 8       # loads per thread per step of the looping kernels
MAX_PARTS = 64   # most blocks one row is split into
SPLIT_THREADS = 512   # several blocks per SM, so one's loads overlap another's waiting


@kernel
def _forward_cached(x, out, log, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float32)
    vals = cuda.local.array(CACHE, float32)
    m = NEG_INF
    for k in range(CACHE):
        c = tid + k * threads
        v = NEG_INF
        if c < n:
            v = load(x, row, c, bf16)
        vals[k] = v
        if v > m or v != v:
            m = v
    m = block_max(buf, m)
    s = float32(0.0)
    for k in range(CACHE):
        if tid + k * threads < n:
            e = expf(vals[k] - m)
            s += e
            if not log:
                vals[k] = e
    s = block_sum(buf, s)
    log_s = logf(s)
    inv_s = float32(1.0) / s
    for k in range(CACHE):
        c = tid + k * threads
        if c < n:
            if log:
                store(out, row, c, (vals[k] - m) - log_s, bf16)
            else:
                store(out, row, c, vals[k] * inv_s, bf16)


@kernel
def _forward_looping(x, out, log, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    buf_m = cuda.shared.array(MAX_THREADS, float32)
    buf_s = cuda.shared.array(MAX_THREADS, float32)
    vals = cuda.local.array(UNROLL, float32)
    m = NEG_INF
    s = float32(0.0)
    for base in range(tid, n, threads * UNROLL):
        for k in range(UNROLL):
            c = base + k * threads
            v = NEG_INF
            if c < n:
                v = load(x, row, c, bf16)
            vals[k] = v
        m, s = online_add_all(m, s, vals)
    m, s = block_online_merge(buf_m, buf_s, m, s)
    log_s = logf(s)
    inv_s = float32(1.0) / s
    for base in range(tid, n, threads * UNROLL):
        for k in range(UNROLL):
            c = base + k * threads
            if c < n:
                vals[k] = load(x, row, c, bf16)
        for k in range(UNROLL):
            c = base + k * threads
            if c < n:
                if log:
                    store(out, row, c, (vals[k] - m) - log_s, bf16)
                else:
                    store(out, row, c, expf(vals[k] - m) * inv_s, bf16)


@kernel
def _backward_cached(y, dy, dx, log, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = y.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float32)
    ys = cuda.local.array(CACHE_BWD, float32)
    gs = cuda.local.array(CACHE_BWD, float32)
    acc = float32(0.0)
    for k in range(CACHE_BWD):
        c = tid + k * threads
        a = float32(0.0)
        g = float32(0.0)
        if c < n:
            a = load(y, row, c, bf16)
            g = load(dy, row, c, bf16)
        ys[k] = a
        gs[k] = g
    for k in range(CACHE_BWD):
        acc += gs[k] if log else ys[k] * gs[k]
    acc = block_sum(buf, acc)
    for k in range(CACHE_BWD):
        c = tid + k * threads
        if c < n:
            if log:
                store(dx, row, c, gs[k] - expf(ys[k]) * acc, bf16)
            else:
                store(dx, row, c, ys[k] * (gs[k] - acc), bf16)


@kernel
def _backward_looping(y, dy, dx, log, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = y.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float32)
    ys = cuda.local.array(UNROLL, float32)
    gs = cuda.local.array(UNROLL, float32)
    acc = float32(0.0)
    lost = float32(0.0)
    for base in range(tid, n, threads * UNROLL):
        for k in range(UNROLL):
            c = base + k * threads
            a = float32(0.0)
            g = float32(0.0)
            if c < n:
                g = load(dy, row, c, bf16)
                if not log:
                    a = load(y, row, c, bf16)
            ys[k] = a
            gs[k] = g
        for k in range(UNROLL):
            acc, lost = kahan_add(acc, lost, gs[k] if log else ys[k] * gs[k])
    acc = block_sum(buf, acc - lost)
    for base in range(tid, n, threads * UNROLL):
        for k in range(UNROLL):
            c = base + k * threads
            if c < n:
                ys[k] = load(y, row, c, bf16)
                gs[k] = load(dy, row, c, bf16)
        for k in range(UNROLL):
            c = base + k * threads
            if c < n:
                if log:
                    store(dx, row, c, gs[k] - expf(ys[k]) * acc, bf16)
                else:
                    store(dx, row, c, ys[k] * (gs[k] - acc), bf16)


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


@kernel
def _forward_split(x, out, stats, sync, parts, log, bf16):
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float32)
    vals = cuda.local.array(CACHE, float32)
    ticket = _take_ticket(sync)
    row = ticket // parts
    part = ticket % parts
    start = part * CACHE * threads + tid
    m = NEG_INF
    for k in range(CACHE):
        c = start + k * threads
        v = NEG_INF
        if c < n:
            v = load(x, row, c, bf16)
        vals[k] = v
        m = nan_max(m, v)
    m = block_max(buf, m)
    s = float32(0.0)
    if m != NEG_INF:
        for k in range(CACHE):
            if start + k * threads < n:
                s += expf(vals[k] - m)
    s = block_sum(buf, s)
    at = row * 2 * parts + part
    if tid == 0:
        stats[at] = m
        stats[at + parts] = s
    _publish_and_wait(sync, row, parts)
    m = NEG_INF
    s = float32(0.0)
    for p in range(parts):
        m, s = online_merge(m, s, cuda.ldcg(stats, row * 2 * parts + p), cuda.ldcg(stats, row * 2 * parts + parts + p))
    log_s = logf(s)
    inv_s = float32(1.0) / s
    for k in range(CACHE):
        c = start + k * threads
        if c < n:
            if log:
                store(out, row, c, (vals[k] - m) - log_s, bf16)
            else:
                store(out, row, c, expf(vals[k] - m) * inv_s, bf16)


@kernel
def _backward_split(y, dy, dx, stats, sync, parts, log, bf16):
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = y.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float32)
    ys = cuda.local.array(CACHE_BWD, float32)
    gs = cuda.local.array(CACHE_BWD, float32)
    ticket = _take_ticket(sync)
    row = ticket // parts
    part = ticket % parts
    start = part * CACHE_BWD * threads + tid
    for k in range(CACHE_BWD):
        c = start + k * threads
        a = float32(0.0)
        g = float32(0.0)
        if c < n:
            a = load(y, row, c, bf16)
            g = load(dy, row, c, bf16)
        ys[k] = a
        gs[k] = g
    acc = float32(0.0)
    for k in range(CACHE_BWD):
        acc += gs[k] if log else ys[k] * gs[k]
    acc = block_sum(buf, acc)
    if tid == 0:
        stats[row * parts + part] = acc
    _publish_and_wait(sync, row, parts)
    acc = float32(0.0)
    for p in range(parts):
        acc += cuda.ldcg(stats, row * parts + p)
    for k in range(CACHE_BWD):
        c = start + k * threads
        if c < n:
            if log:
                store(dx, row, c, gs[k] - expf(ys[k]) * acc, bf16)
            else:
                store(dx, row, c, ys[k] * (gs[k] - acc), bf16)


@functools.lru_cache(maxsize=None)
def _max_parts(device_index: int) -> int:
    """Most parts a row may be split into on this GPU: few enough that they are always
    resident together (half the SMs, one block each), and at most MAX_PARTS."""
    return min(MAX_PARTS, torch.cuda.get_device_properties(device_index).multi_processor_count // 2)


def _plan(n: int, cache: int, device=None):
    """('cached' | 'split' | 'looping', threads per block, parts per row)."""
    threads = threads_for(n, 8)
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
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 2, x.device)
        launch(_forward_split, rows * parts, threads, (x, out, stats, sync, numpy.int64(parts), bool(log), is_bf16(x)))
    else:
        launch(_forward_cached if path == "cached" else _forward_looping, rows, threads,
               (x, out, bool(log), is_bf16(x)))


def backward(y, dy, dx, log: bool, plan=None) -> None:
    rows, n = y.shape
    path, threads, parts = plan or _plan(n, CACHE_BWD, y.device)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 1, y.device)
        launch(_backward_split, rows * parts, threads,
               (y, dy, dx, stats, sync, numpy.int64(parts), bool(log), is_bf16(y)))
    else:
        launch(_backward_cached if path == "cached" else _backward_looping, rows, threads,
               (y, dy, dx, bool(log), is_bf16(y)))
