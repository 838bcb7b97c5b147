"""The block-sparse forward and backward kernels that hold a row's values as float32 (every dtype; 16-bit rows
read one element at a time, or with a scale that is not positive in the forward)."""

import functools

from numba import cuda, float32, int64

from ._blocksparse_rows import (ZERO, causal_kept, jit_for, nan_row, not_finite, row_place, shift_of, stash_io,
                                vector_at, zero_past_writer)
from ._device import NEG_INF, exp2f, kahan_add, nan_max, row_io, row_reductions
from ._launch import device_function


@functools.cache
def forward_kernel(fmt, width, causal, floats, lanes, warps):
    """The forward for element format `fmt` in vectors of `width`, `floats` values per lane
    (a multiple of width), `lanes` lanes per row, `warps` rows per block; scores in log2 units (c * x, c =
    scale * log2(e)), each term one ex2. The first `stash` tiles of a row longer than one are kept in shared
    memory (dynamic, `stash` tiles a row) by the first pass for the second, which reads only the others again."""
    vectors = floats // width
    tile = lanes * vectors
    held = lanes * floats   # a tile's values, a row
    read, write = row_io(fmt, width)
    keep, fetch = stash_io(floats, lanes)
    merge_log2, _ = row_reductions(lanes)
    zero_past = zero_past_writer(fmt, width, lanes)

    @device_function
    def load_scores(x, vals, base, t, lane, n_vectors, log2b, log2v, c):
        """vals = c * x over tile t (c = scale * log2(e): scores in log2 units); -inf past the row's end."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            at = k * width
            if v < n_vectors:
                read(x, vector_at(base, v, log2b, log2v), vals, at)
                for j in range(width):
                    vals[at + j] *= c
            else:
                for j in range(width):
                    vals[at + j] = NEG_INF

    @device_function
    def mask_past(vals, t, lane, kept):
        """-inf for the elements of tile t past the row's first `kept` (the causal mask's prefix)."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v * width + width > kept:
                for j in range(width):
                    if v * width + j >= kept:
                        vals[k * width + j] = NEG_INF

    @device_function
    def store_tile(out, vals, base, t, lane, n_vectors, log2b, log2v):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                write(out, vector_at(base, v, log2b, log2v), vals, k * width)

    @jit_for(lanes * warps)
    def blocksparse_forward(x, out, offsets, causal_prefix, batch, rows, nnz, log2b, log2v, c, stash):
        lane = int64(cuda.threadIdx.x % lanes)
        vals = cuda.local.array(floats, float32)
        saved = cuda.shared.array(0, float32)
        slot = int64(cuda.threadIdx.x // lanes) * (stash * held) + lane   # the lane's first slot of the stash
        z = int64(cuda.blockIdx.y)
        while z < batch:
            row_id = int64(cuda.blockIdx.x) * warps + cuda.threadIdx.x // lanes
            while row_id < rows:
                first, n_vectors, group, i, base = row_place(z, row_id, offsets, nnz, log2b, log2v)
                kept = causal_kept(causal_prefix, group, i, log2b) if causal else int64(0)
                tiles = (n_vectors + tile - 1) // tile
                # pass 1: the lane's running (max m, sum s of 2**(score - m)); vals ends as the last tile's terms
                m = NEG_INF
                s = float32(0.0)
                for t in range(tiles):
                    load_scores(x, vals, base, t, lane, n_vectors, log2b, log2v, c)
                    if causal:
                        mask_past(vals, t, lane, kept)
                    if t < stash and t < tiles - 1:
                        keep(saved, vals, slot + t * held)
                    top = NEG_INF
                    for k in range(floats):
                        top = nan_max(top, vals[k])
                    if top > m or top != top:
                        s *= exp2f(m - top)
                        m = top
                    acc = float32(0.0)
                    shift = float32(0.0) if m == NEG_INF else m  # nothing but -inf so far: 2**(-inf - 0) = 0
                    for k in range(floats):
                        vals[k] = exp2f(vals[k] - shift)
                        acc += vals[k]
                    s += acc
                row_m, row_s = merge_log2(m, s)
                empty = kept == 0 if causal else False   # nothing unmasked: zeros
                row_shift = shift_of(row_m)
                inv_s = ZERO if empty else float32(1.0) / row_s
                # the last tile's terms are 2**(score - m) (m the lane's max; 2**score where that is -inf)
                factor = ZERO if empty else exp2f(m - row_shift) * inv_s
                remask = causal and not empty and nan_row(row_m, row_s)
                # pass 2: the last tile from registers, the stashed ones from shared memory, the others read again
                # (zeros if the row is empty)
                if tiles > 0:
                    for k in range(floats):
                        vals[k] *= factor
                    store_tile(out, vals, base, tiles - 1, lane, n_vectors, log2b, log2v)
                for t in range(tiles - 1):
                    if empty:
                        for k in range(floats):
                            vals[k] = ZERO
                    else:
                        if t < stash:
                            fetch(saved, vals, slot + t * held)
                        else:
                            load_scores(x, vals, base, t, lane, n_vectors, log2b, log2v, c)
                            if causal:
                                mask_past(vals, t, lane, kept)
                        for k in range(floats):
                            vals[k] = exp2f(vals[k] - row_shift) * inv_s
                    store_tile(out, vals, base, t, lane, n_vectors, log2b, log2v)
                if remask:
                    zero_past(out, vals, base, lane, n_vectors, kept, log2b, log2v)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_forward


@functools.cache
def backward_kernel(fmt, width, floats, lanes, warps, stash=0):
    """The backward for element format `fmt` in vectors of `width`, `floats` values of y and
    of dy per lane (a multiple of width), `lanes` lanes per row, `warps` rows per block. The first `stash` tiles
    of y and dy of a row longer than one are kept in shared memory for the second pass, as the forward's, but
    with `stash` and the shared array fixed at compile time: a run-time count, or dynamic shared memory, took the
    float32 kernel of 32 values a lane from 96 registers to 128 (sm_90)."""
    vectors = floats // width
    tile = lanes * vectors
    held = lanes * floats
    stash_size = max(1, warps * stash * 2 * held)
    read, write = row_io(fmt, width)
    keep, fetch = stash_io(floats, lanes)
    _, row_sum = row_reductions(lanes)

    @device_function
    def load_tile(y, dy, ys, gs, base, t, lane, n_vectors, log2b, log2v):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            at = k * width
            if v < n_vectors:
                place = vector_at(base, v, log2b, log2v)
                read(y, place, ys, at)
                read(dy, place, gs, at)
            else:
                for j in range(width):
                    ys[at + j] = float32(0.0)
                    gs[at + j] = float32(0.0)

    @device_function
    def store_tile(dx, ys, gs, base, t, lane, n_vectors, log2b, log2v, dot, scale, unsure):
        """dx = scale * y * (dy - dot) over tile t (computed in gs), 0 wherever y is 0 (a select only where the dot
        is `unsure`, not_finite)."""
        if unsure:
            for k in range(floats):
                gs[k] = ZERO if ys[k] == 0 else scale * ys[k] * (gs[k] - dot)
        else:
            for k in range(floats):
                gs[k] = scale * ys[k] * (gs[k] - dot)
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                write(dx, vector_at(base, v, log2b, log2v), gs, k * width)

    @jit_for(lanes * warps)
    def blocksparse_backward(y, dy, dx, offsets, batch, rows, nnz, log2b, log2v, scale):
        lane = int64(cuda.threadIdx.x % lanes)
        ys = cuda.local.array(floats, float32)
        gs = cuda.local.array(floats, float32)
        saved = cuda.shared.array(stash_size, float32)
        slot = int64(cuda.threadIdx.x // lanes) * (stash * 2 * held) + lane   # y's tile t at 2t, dy's at 2t + 1
        z = int64(cuda.blockIdx.y)
        while z < batch:
            row_id = int64(cuda.blockIdx.x) * warps + cuda.threadIdx.x // lanes
            while row_id < rows:
                first, n_vectors, group, i, base = row_place(z, row_id, offsets, nnz, log2b, log2v)
                tiles = (n_vectors + tile - 1) // tile
                dot = float32(0.0)
                lost = float32(0.0)
                for t in range(tiles):
                    load_tile(y, dy, ys, gs, base, t, lane, n_vectors, log2b, log2v)
                    if t < stash and t < tiles - 1:
                        keep(saved, ys, slot + 2 * t * held)
                        keep(saved, gs, slot + (2 * t + 1) * held)
                    acc = float32(0.0)
                    for k in range(floats):
                        acc += ys[k] * gs[k]
                    dot, lost = kahan_add(dot, lost, acc)
                dot = row_sum(dot - lost)
                unsure = not_finite(dot)
                if tiles > 0:
                    store_tile(dx, ys, gs, base, tiles - 1, lane, n_vectors, log2b, log2v, dot, scale, unsure)
                for t in range(tiles - 1):
                    if t < stash:
                        fetch(saved, ys, slot + 2 * t * held)
                        fetch(saved, gs, slot + (2 * t + 1) * held)
                    else:
                        load_tile(y, dy, ys, gs, base, t, lane, n_vectors, log2b, log2v)
                    store_tile(dx, ys, gs, base, t, lane, n_vectors, log2b, log2v, dot, scale, unsure)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_backward
