"""Row softmax and log_softmax, forward and backward.

Three paths, chosen by the row length N:

- tile: next_power_of_2(N) <= SOFTMAX_*_TILE_MAX; a program holds a whole tile of rows
  (several short rows per program) and reads and writes each element once. The
  16-bit forward of rows of 32768 (PREFETCH_FROM) runs as persistent programs
  that load their next row while they reduce and store the current one.
- split (CUDA only): a long row is cut into chunks held in registers by
  cooperating programs that swap per-chunk statistics through global memory,
  so each element is still read and written once. The 16-bit forward streams
  its chunks instead and reads them twice, the second time mostly from L2
  (SPLIT_STREAM).
- loop: one program per row streams it twice (statistics, then output); any
  length. The interpreter takes it for long rows, since its programs run one
  after another and cannot wait for each other.

The 16-bit backward holds long rows' values as loaded rather than as floats
(RAW_FROM), half the registers. The settings named here are in _tuning.
"""
import math

import torch
import triton
import triton.language as tl

from . import _tuning, simulated
from ._device import fast_exp, online_max, safe_shift, widen
from ._launch import LAUNCH, launch, next_power_of_2, on_device, sm_count, warps_for


@triton.jit
def _rows_output(x, LOG: tl.constexpr):
    """softmax or log_softmax of each row of the float32 [ROWS, BLOCK] x."""
    shifted = x - tl.max(x, axis=1)[:, None]
    e = fast_exp(shifted)
    total = tl.sum(e, axis=1)
    if LOG:
        return shifted - tl.log(total)[:, None]
    return e * (1.0 / total)[:, None]


@triton.jit
def _fwd_tile_kernel(x_ptr, out_ptr, M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    tl.store(out_ptr + offsets, _rows_output(x, LOG).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_prefetch_kernel(x_ptr, out_ptr, M, N, BLOCK: tl.constexpr, LOG: tl.constexpr):
    """The forward of one row a program, as persistent programs that walk the rows a grid apart and have the next
    row's loads in flight while they reduce and store the current one."""
    cols = tl.arange(0, BLOCK)[None, :]
    step = tl.num_programs(0)
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)[:, None]  # [1, 1]: a scalar in a mask trips the interpreter
    upcoming = tl.load(x_ptr + row * N + cols, mask=(row < M) & (cols < N), other=-float("inf"))
    for _ in range(tl.program_id(0), M, step):
        x = upcoming.to(tl.float32)
        following = row + step
        upcoming = tl.load(x_ptr + following * N + cols, mask=(following < M) & (cols < N), other=-float("inf"))
        tl.store(out_ptr + row * N + cols, _rows_output(x, LOG).to(out_ptr.dtype.element_ty), mask=cols < N)
        row = following


@triton.jit
def _fwd_loop_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, LOG: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), -float("inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        run_max, shift, run_sum = online_max(run_max, run_sum, tl.max(x, axis=0))
        run_sum += tl.sum(fast_exp(x - shift), axis=0)
    log_sum = tl.log(run_sum)
    inverse = 1.0 / run_sum
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        shifted = x - run_max
        if LOG:
            y = shifted - log_sum
        else:
            y = fast_exp(shifted) * inverse
        tl.store(out_ptr + row_start + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _claim_chunk(count_ptr, N, chunks, CHUNK: tl.constexpr):
    """This program's chunk: its row, its ticket (the chunk's index over all rows), offsets and mask.
    The ticket is taken in start order from a counter, so the programs waiting on a row never keep
    that row's remaining chunks from starting."""
    ticket = tl.atomic_add(count_ptr, 1).to(tl.int64)
    row = ticket // chunks
    cols = (ticket % chunks) * CHUNK + tl.arange(0, CHUNK)
    return row, ticket, row * N + cols, cols < N


@triton.jit
def _arrive(counter_ptr):
    """Publish this chunk's statistics (stored before): count the chunk on its row's counter. Returns the
    count so far, for _wait."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1


@triton.jit
def _wait(counter_ptr, arrived, chunks):
    """Wait until all chunks of the row have arrived."""
    while arrived < chunks:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _wait_for_row(counter_ptr, chunks):
    """Publish this chunk's statistics, then wait until all chunks of the row have."""
    _wait(counter_ptr, _arrive(counter_ptr), chunks)


@triton.jit
def _row_statistics(max_ptr, sum_ptr, count_ptr, row, chunks, CHUNKS_P2: tl.constexpr,
                    COUNTER_STRIDE: tl.constexpr):
    """Once every chunk of the row has published its (max, sum of exp(x - max)): the row's max and its sum
    of exp(x - row max)."""
    _wait_for_row(count_ptr + (row + 1) * COUNTER_STRIDE, chunks)
    parts = row * chunks + tl.arange(0, CHUNKS_P2)
    part_mask = tl.arange(0, CHUNKS_P2) < chunks
    part_max = tl.load(max_ptr + parts, mask=part_mask, other=-float("inf"), volatile=True)
    part_sum = tl.load(sum_ptr + parts, mask=part_mask, other=0.0, volatile=True)
    row_max = tl.max(part_max, axis=0)
    return row_max, tl.sum(part_sum * fast_exp(part_max - safe_shift(row_max)), axis=0)


@triton.jit
def _fwd_split_kernel(x_ptr, out_ptr, max_ptr, sum_ptr, count_ptr, N, chunks, CHUNK: tl.constexpr,
                      CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, COUNTER_STRIDE: tl.constexpr):
    row, ticket, offsets, mask = _claim_chunk(count_ptr, N, chunks, CHUNK)
    x = tl.load(x_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    local_max = tl.max(x, axis=0)
    tl.store(max_ptr + ticket, local_max)
    tl.store(sum_ptr + ticket, tl.sum(fast_exp(x - safe_shift(local_max)), axis=0))
    row_max, total = _row_statistics(max_ptr, sum_ptr, count_ptr, row, chunks, CHUNKS_P2, COUNTER_STRIDE)
    shifted = x - row_max
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = fast_exp(shifted) * (1.0 / total)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_split_stream_kernel(x_ptr, out_ptr, max_ptr, sum_ptr, count_ptr, N, chunks, CHUNK: tl.constexpr,
                             SUB: tl.constexpr, STAGES: tl.constexpr, CHUNKS_P2: tl.constexpr,
                             LOG: tl.constexpr, COUNTER_STRIDE: tl.constexpr):
    """The split forward with its chunk not held in registers (which keep 16-bit data as floats): streamed
    in SUB-element steps for the statistics, and again, mostly from L2, for the output. STAGES > 1
    pipelines the loads through shared memory."""
    row, ticket, _, _ = _claim_chunk(count_ptr, N, chunks, 1)
    row_start = row * N
    cols = (ticket % chunks) * CHUNK + tl.arange(0, SUB)
    # The statistics pass keeps a running (max, sum) per 16-byte vector of a step ([SUB // VEC, VEC], each row
    # one thread's load), so a step reduces within threads and the chunk's are combined once, instead of a
    # block-wide max and sum per step (docs/tuning.md, SPLIT_STREAM).
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    lanes = (ticket % chunks) * CHUNK + tl.arange(0, SUB // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    lane_max = tl.full((SUB // VEC,), -float("inf"), tl.float32)
    lane_sum = tl.zeros((SUB // VEC,), tl.float32)
    for start in tl.range(0, CHUNK, SUB, num_stages=STAGES):
        x = tl.load(x_ptr + row_start + start + lanes, mask=start + lanes < N, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        lane_max, shift, lane_sum = online_max(lane_max, lane_sum, tl.max(x, axis=1))
        lane_sum += tl.sum(fast_exp(x - shift[:, None]), axis=1)
    run_max = tl.max(lane_max, axis=0)
    run_sum = tl.sum(lane_sum * fast_exp(lane_max - safe_shift(run_max)), axis=0)
    tl.store(max_ptr + ticket, run_max)
    tl.store(sum_ptr + ticket, run_sum)
    row_max, total = _row_statistics(max_ptr, sum_ptr, count_ptr, row, chunks, CHUNKS_P2, COUNTER_STRIDE)
    log_total = tl.log(total)
    inverse = 1.0 / total
    for start in tl.range(0, CHUNK, SUB, num_stages=STAGES):
        offsets = row_start + start + cols
        mask = start + cols < N
        shifted = tl.load(x_ptr + offsets, mask=mask, other=-float("inf"),
                          eviction_policy="evict_first").to(tl.float32) - row_max
        if LOG:
            y = shifted - log_total
        else:
            y = fast_exp(shifted) * inverse
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gradient_total(y, dy, LOG: tl.constexpr, axis: tl.constexpr):
    """The row term of the backward: sum(dy) for log_softmax, sum(y * dy) for softmax."""
    if LOG:
        return tl.sum(dy.to(tl.float32), axis=axis)
    return tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=axis)


@triton.jit
def _gradient(y, dy, total, LOG: tl.constexpr):
    if LOG:
        return dy - fast_exp(y) * total
    return y * (dy - total)


@triton.jit
def _bwd_tile_kernel(y_ptr, dy_ptr, dx_ptr, M, N, zero, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     LOG: tl.constexpr, RAW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    total = _gradient_total(y, dy, LOG, axis=1)[:, None]
    dx = _gradient(widen(y, zero, RAW), widen(dy, zero, RAW), total, LOG)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_loop_kernel(y_ptr, dy_ptr, dx_ptr, N, BLOCK: tl.constexpr, LOG: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((), tl.float32)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        dy = tl.load(dy_ptr + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            total += tl.sum(dy, axis=0)
        else:
            y = tl.load(y_ptr + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
            total += tl.sum(y * dy, axis=0)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        y = tl.load(y_ptr + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row_start + start + cols, mask=mask, other=0.0).to(tl.float32)
        dx = _gradient(y, dy, total, LOG)
        tl.store(dx_ptr + row_start + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_split_kernel(y_ptr, dy_ptr, dx_ptr, sum_ptr, count_ptr, N, chunks, zero, CHUNK: tl.constexpr,
                      CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, COUNTER_STRIDE: tl.constexpr,
                      RAW: tl.constexpr, LATE_Y: tl.constexpr):
    row, ticket, offsets, mask = _claim_chunk(count_ptr, N, chunks, CHUNK)
    counter_ptr = count_ptr + (row + 1) * COUNTER_STRIDE
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0)
    if LOG and LATE_Y:
        # log_softmax's row term needs dy only: y is loaded while the row's other chunks are awaited
        tl.store(sum_ptr + ticket, tl.sum(dy.to(tl.float32), axis=0))
        arrived = _arrive(counter_ptr)
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
        _wait(counter_ptr, arrived, chunks)
    else:
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
        tl.store(sum_ptr + ticket, _gradient_total(y, dy, LOG, axis=0))
        _wait_for_row(counter_ptr, chunks)
    parts = row * chunks + tl.arange(0, CHUNKS_P2)
    part_mask = tl.arange(0, CHUNKS_P2) < chunks
    total = tl.sum(tl.load(sum_ptr + parts, mask=part_mask, other=0.0, volatile=True), axis=0)
    dx = _gradient(widen(y, zero, RAW), widen(dy, zero, RAW), total, LOG)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _tile_rows(x, block):
    return max(1, min(_tuning.SOFTMAX_TILE_ELEMENTS[x.element_size()] // block, next_power_of_2(x.shape[0])))


def _split_config(x, N):
    """(chunk, num_warps) for the split path, or None when the loop path must be taken.

    A row's chunks wait for each other. Programs take their (row, chunk) in start
    order from a ticket counter, so only the newest row can miss chunks that have
    not started: a row must not have more chunks than programs can run at once
    (at least one per multiprocessor)."""
    if simulated() or not x.is_cuda:
        return None
    most_chunks = sm_count(x)
    for chunk, warps in _tuning.SPLIT_CONFIGS:
        if triton.cdiv(N, chunk) <= most_chunks:
            return chunk, warps
    return None


def _held_raw(x, path, block):
    """Whether this path holds x's 16-bit values as loaded for rows of `block` (RAW_FROM), not as floats."""
    return x.element_size() == 2 and block >= _tuning.RAW_FROM.get(path, float("inf"))


def _split_counters(x, M):
    """Zeroed int32 counters: the ticket, then one per row, SPLIT_COUNTER_STRIDE apart."""
    return torch.zeros((M + 1) * _tuning.SPLIT_COUNTER_STRIDE, device=x.device, dtype=torch.int32)


def forward(x, out, log):
    """out = softmax(x) or log_softmax(x) along dim 1 of the (M, N) tensor x."""
    M, N = x.shape
    if M == 0 or N == 0:
        return
    block = next_power_of_2(N)
    size = x.element_size()
    with on_device(x):
        if _tuning.PREFETCH_FROM.get(size, math.inf) <= block <= _tuning.SOFTMAX_FORWARD_TILE_MAX[size]:
            programs = max(1, sm_count(x)) * max(1, _tuning.PREFETCH_SM_ELEMENTS // block)
            launch(_fwd_prefetch_kernel, (min(M, programs),), x, out, M, N, BLOCK=block, LOG=log,
                   num_warps=warps_for(block), **LAUNCH)
            return
        if block <= _tuning.SOFTMAX_FORWARD_TILE_MAX[size]:
            rows = _tile_rows(x, block)
            launch(_fwd_tile_kernel, (triton.cdiv(M, rows),), x, out, M, N, ROWS=rows, BLOCK=block, LOG=log,
                   num_warps=warps_for(rows * block), **LAUNCH)
            return
        config = _split_config(x, N)
        if config is None:
            launch(_fwd_loop_kernel, (M,), x, out, N, BLOCK=_tuning.SOFTMAX_LOOP_BLOCK, LOG=log, num_warps=8, **LAUNCH)
            return
        cap = _tuning.SPLIT_FORWARD_MAXNREG.get(size)
        options = {**LAUNCH, "maxnreg": cap} if cap else LAUNCH
        stream = _tuning.SPLIT_STREAM.get(size)
        if stream is not None and triton.cdiv(N, stream[0]) <= sm_count(x):
            chunk, sub, warps, stages = stream
            chunks = triton.cdiv(N, chunk)
            stats = torch.empty((2, M * chunks), device=x.device, dtype=torch.float32)
            launch(_fwd_split_stream_kernel, (M * chunks,), x, out, stats[0], stats[1], _split_counters(x, M), N,
                   chunks, CHUNK=chunk, SUB=sub, STAGES=stages, CHUNKS_P2=next_power_of_2(chunks), LOG=log,
                   COUNTER_STRIDE=_tuning.SPLIT_COUNTER_STRIDE, num_warps=warps, **options)
            return
        chunk, warps = config
        chunks = triton.cdiv(N, chunk)
        stats = torch.empty((2, M * chunks), device=x.device, dtype=torch.float32)
        launch(_fwd_split_kernel, (M * chunks,), x, out, stats[0], stats[1], _split_counters(x, M), N, chunks,
               CHUNK=chunk, CHUNKS_P2=next_power_of_2(chunks), LOG=log, COUNTER_STRIDE=_tuning.SPLIT_COUNTER_STRIDE,
               num_warps=warps, **options)


def backward(y, dy, dx, log):
    """dx from the forward's output y and the incoming gradient dy (all (M, N))."""
    M, N = y.shape
    if M == 0 or N == 0:
        return
    block = next_power_of_2(N)
    with on_device(y):
        if block <= _tuning.SOFTMAX_BACKWARD_TILE_MAX[y.element_size()]:
            rows = _tile_rows(y, block)
            launch(_bwd_tile_kernel, (triton.cdiv(M, rows),), y, dy, dx, M, N, 0, ROWS=rows, BLOCK=block, LOG=log,
                   RAW=_held_raw(y, "backward tile", block), num_warps=warps_for(2 * rows * block), **LAUNCH)
            return
        config = _split_config(y, N)
        if config is None:
            launch(_bwd_loop_kernel, (M,), y, dy, dx, N, BLOCK=_tuning.SOFTMAX_LOOP_BLOCK, LOG=log, num_warps=8,
                   **LAUNCH)
            return
        chunk, warps = config
        chunks = triton.cdiv(N, chunk)
        sums = torch.empty(M * chunks, device=y.device, dtype=torch.float32)
        launch(_bwd_split_kernel, (M * chunks,), y, dy, dx, sums, _split_counters(y, M), N, chunks, 0, CHUNK=chunk,
               CHUNKS_P2=next_power_of_2(chunks), LOG=log, COUNTER_STRIDE=_tuning.SPLIT_COUNTER_STRIDE,
               RAW=_held_raw(y, "backward split", block), LATE_Y=_tuning.SPLIT_LATE_Y[y.element_size()],
               num_warps=warps, **LAUNCH)
