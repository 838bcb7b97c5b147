"""The block-sparse forward (positive scale) and backward kernels for 16-bit rows read in pairs, which hold a row's
values as their words, two a register (_device.packed_io)."""

import functools

from numba import cuda, float32, int32, int64

from ._blocksparse_rows import (ZERO, causal_kept, jit_for, nan_row, not_finite, row_place, shift_of, stash_io,
                                vector_at, zero_past_writer)
from ._device import (HALF_SHIFT, LOW_HALF, NEG_INF, exp2f, fresh_shift, kahan_add, packed_io, packed_max,
                      packed_pad, row_io, row_reductions, share_shift)
from ._intrinsics import vector_access
from ._launch import device_function


@device_function
def _unseen_shift():
    """HALF_SHIFT, passed through shared memory so that the compiler cannot fold it: the packed kernels unpack
    their words with it after a first pass that used the constant, so they keep the words, not the first pass's
    floats (see _device.packed_io). A barrier: every thread of the block calls it."""
    slot = cuda.shared.array(1, int32)
    share_shift(slot)
    cuda.syncthreads()
    return fresh_shift(slot)


@functools.cache
def _packed_tile_load(fmt, width, values, lanes):
    """load(array, words, tmp, base, t, lane, n_vectors, log2b, log2v, pad): tile t's words of a 16-bit row held
    as its words (_device.packed_io), `values` elements per lane, into `words` (`pad` past the row's end)."""
    vectors = values // width
    count = width // 2
    tile = lanes * vectors
    load_words, _ = vector_access(count)

    @device_function
    def load(array, words, tmp, base, t, lane, n_vectors, log2b, log2v, pad):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                load_words(array, vector_at(base, v, log2b, log2v), tmp)
                for j in range(count):
                    words[k * count + j] = tmp[j]
            else:
                for j in range(count):
                    words[k * count + j] = pad

    return load


@functools.cache
def forward_packed_kernel(fmt, width, causal, values, lanes, warps):
    """The forward (scores in log2 units, as forward_kernel's) for 16-bit rows read in pairs and a positive
    scale, `values` elements per lane held as their words (two a register, _device.packed_io): twice the row in
    registers of the float kernel, so that rows of the layout's mean length are read once. Masked elements get
    -inf bits, which a positive scale keeps -inf; the output takes each exponential again, from words unpacked
    with a shift the compiler cannot see (the first pass's floats are not kept). The first `stash` tiles of a row
    longer than one are kept in shared memory for the second pass, as the float kernel's."""
    vectors = values // width
    count = width // 2
    held = values // 2   # words per lane
    tile = lanes * vectors
    load = _packed_tile_load(fmt, width, values, lanes)
    keep, fetch = stash_io(held, lanes)
    merge_log2, _ = row_reductions(lanes)
    _, unpack = packed_io(fmt, width, vectors)
    _, write = row_io(fmt, width)
    pair_max, word_max = packed_max(fmt)
    zero_past = zero_past_writer(fmt, width, lanes)
    pad = packed_pad(fmt, NEG_INF)
    neg_bits = int32(pad & LOW_HALF)   # one 16-bit -inf

    @device_function
    def mask_past(words, t, lane, kept):
        """-inf bits for the elements of tile t past the row's first `kept` (the causal mask's prefix)."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v * width < kept and v * width + width > kept:   # the diagonal cuts this vector
                for j in range(width):
                    if v * width + j >= kept:
                        at = k * count + j // 2
                        place = HALF_SHIFT * (j % 2)
                        words[at] = int32((words[at] & ~(LOW_HALF << place)) | (neg_bits << place))

    @device_function
    def store_tile(out, words, vec, base, t, lane, n_vectors, log2b, log2v, c, row_shift, inv_s, shift):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                for j in range(width):
                    vec[j] = exp2f(unpack(words, k * width + j, shift) * c - row_shift) * inv_s
                write(out, vector_at(base, v, log2b, log2v), vec, 0)

    @device_function
    def store_zeros(out, vec, base, t, lane, n_vectors, log2b, log2v):
        for j in range(width):
            vec[j] = float32(0.0)
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                write(out, vector_at(base, v, log2b, log2v), vec, 0)

    @jit_for(lanes * warps)
    def blocksparse_forward_packed(x, out, offsets, causal_prefix, batch, rows, nnz, log2b, log2v, c, stash):
        shift = _unseen_shift()
        lane = int64(cuda.threadIdx.x % lanes)
        words = cuda.local.array(held, int32)
        tmp = cuda.local.array(count, int32)
        vec = cuda.local.array(width, float32)
        saved = cuda.shared.array(0, int32)
        slot = int64(cuda.threadIdx.x // lanes) * (stash * lanes * held) + lane
        z = int64(cuda.blockIdx.y)
        while z < batch:
            row_id = int64(cuda.blockIdx.x) * warps + cuda.threadIdx.x // lanes
            while row_id < rows:
                first, n_vectors, group, i, base = row_place(z, row_id, offsets, nnz, log2b, log2v)
                read_vectors = n_vectors   # vectors read: those holding kept elements
                kept = int64(0)
                if causal:
                    kept = causal_kept(causal_prefix, group, i, log2b)
                    read_vectors = (kept + width - 1) // width
                tiles = (n_vectors + tile - 1) // tile
                # pass 1: the lane's running (max m, sum s) of the scores
                m = NEG_INF
                s = float32(0.0)
                for t in range(tiles):
                    load(x, words, tmp, base, t, lane, read_vectors, log2b, log2v, pad)
                    if causal:
                        mask_past(words, t, lane, kept)
                    if t < stash and t < tiles - 1:
                        keep(saved, words, slot + t * lanes * held)
                    w = words[0]
                    for q in range(1, held):
                        w = pair_max(w, words[q])
                    top = word_max(w) * c
                    if top > m or top != top:
                        s *= exp2f(m - top)
                        m = top
                    if m != NEG_INF:   # nothing but -inf so far: nothing to add
                        acc = float32(0.0)
                        for k in range(values):
                            acc += exp2f(unpack(words, k, HALF_SHIFT) * c - m)
                        s += acc
                row_m, row_s = merge_log2(m, s)
                if causal and kept == 0:   # nothing unmasked: zeros
                    for t in range(tiles):
                        store_zeros(out, vec, base, t, lane, n_vectors, log2b, log2v)
                else:
                    row_shift = shift_of(row_m)
                    inv_s = float32(1.0) / row_s
                    # pass 2: the last tile from registers, the stashed ones from shared memory, the others read
                    # again
                    if tiles > 0:
                        store_tile(out, words, vec, base, tiles - 1, lane, n_vectors, log2b, log2v, c, row_shift,
                                   inv_s, shift)
                    for t in range(tiles - 1):
                        if t < stash:
                            fetch(saved, words, slot + t * lanes * held)
                        else:
                            load(x, words, tmp, base, t, lane, read_vectors, log2b, log2v, pad)
                            if causal:
                                mask_past(words, t, lane, kept)
                        store_tile(out, words, vec, base, t, lane, n_vectors, log2b, log2v, c, row_shift, inv_s,
                                   shift)
                    if causal and nan_row(row_m, row_s):   # masked elements' terms are NaN too: 0
                        zero_past(out, vec, base, lane, n_vectors, kept, log2b, log2v)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_forward_packed


@functools.cache
def backward_packed_kernel(fmt, width, values, lanes, warps):
    """The backward for 16-bit rows read in pairs, `values` elements of y and of dy per lane held as their words
    (two a register): rows of the layout's mean length read once, where floats held half as many. The output
    unpacks the words again with a shift the compiler cannot see (the first pass's floats are not kept)."""
    vectors = values // width
    count = width // 2
    held = values // 2   # words per lane
    tile = lanes * vectors
    load = _packed_tile_load(fmt, width, values, lanes)
    _, unpack = packed_io(fmt, width, vectors)
    _, write = row_io(fmt, width)
    _, row_sum = row_reductions(lanes)

    @device_function
    def store_tile(dx, ys, gs, vec, base, t, lane, n_vectors, log2b, log2v, dot, scale, shift, unsure):
        """dx = scale * y * (dy - dot) over tile t, 0 wherever y is 0 (a select only where the dot is `unsure`,
        not_finite)."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                for j in range(width):
                    at = k * width + j
                    vec[j] = scale * unpack(ys, at, shift) * (unpack(gs, at, shift) - dot)
                if unsure:
                    for j in range(width):
                        if unpack(ys, k * width + j, shift) == 0:
                            vec[j] = ZERO
                write(dx, vector_at(base, v, log2b, log2v), vec, 0)

    @jit_for(lanes * warps)
    def blocksparse_backward_packed(y, dy, dx, offsets, batch, rows, nnz, log2b, log2v, scale):
        shift = _unseen_shift()
        lane = int64(cuda.threadIdx.x % lanes)
        ys = cuda.local.array(held, int32)
        gs = cuda.local.array(held, int32)
        tmp = cuda.local.array(count, int32)
        vec = cuda.local.array(width, float32)
        z = int64(cuda.blockIdx.y)
        while z < batch:
            row_id = int64(cuda.blockIdx.x) * warps + cuda.threadIdx.x // lanes
            while row_id < rows:
                first, n_vectors, group, i, base = row_place(z, row_id, offsets, nnz, log2b, log2v)
                tiles = (n_vectors + tile - 1) // tile
                dot = float32(0.0)
                lost = float32(0.0)
                for t in range(tiles):
                    load(y, ys, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    load(dy, gs, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    acc = float32(0.0)
                    for k in range(values):
                        acc += unpack(ys, k, HALF_SHIFT) * unpack(gs, k, HALF_SHIFT)
                    dot, lost = kahan_add(dot, lost, acc)
                dot = row_sum(dot - lost)
                unsure = not_finite(dot)
                if tiles > 0:
                    store_tile(dx, ys, gs, vec, base, tiles - 1, lane, n_vectors, log2b, log2v, dot, scale, shift,
                               unsure)
                for t in range(tiles - 1):
                    load(y, ys, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    load(dy, gs, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    store_tile(dx, ys, gs, vec, base, t, lane, n_vectors, log2b, log2v, dot, scale, shift, unsure)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_backward_packed
