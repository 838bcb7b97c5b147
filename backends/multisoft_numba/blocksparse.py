"""Block-sparse softmax over the compressed blocks (Z, nnz, B, B), forward and backward.

Row i of block-row g = h * Mb + r in batch z is the concatenation of row i of the
blocks offsets[g] .. offsets[g + 1]; rows of a batch entry are numbered (g, i), and
the grid's y index walks the batch (no division per row). A row takes `lanes` lanes of a
warp (32, or fewer for short rows: ROW_LANE_BYTES), WARPS warps per thread block,
grid-stride over the rows; under the simulator, which has no shuffles, one row per block.
The data is read and written in vectors of `width` elements, one access each
(_device.row_io; the widest that the tensors' alignment allows, see
_glue.vector_views), through 1-D views indexed with unsigned integers. Vector v of a
row lies in block v // V at vector v % V of its row (V vectors per block row); lane
`lane` holds the vectors t * TILE + k * lanes + lane (k < vectors per lane) of tile
t, so each load of a row's lanes reads consecutive vectors. A row of one tile is
read once and written from registers; a longer row keeps its first tiles in shared
memory for the second pass (STASH_BYTES) and reads the others again (the last one
excepted).

Causal masking keeps a prefix of each row: the look-up table lists a block-row's blocks
by ascending column, so the elements kept are those of the blocks left of the diagonal,
then i + 1 of the diagonal block if the row has it (the front's lut.causal, _causal_kept);
elements past the prefix are -inf (the float kernel reads the row's vectors and masks them,
the 16-bit one reads no vector wholly past the prefix).
"""

import functools
import math

import numpy
from numba import cuda, float32, int32, int64, uint64

from ._device import (HALF_SHIFT, LOW_HALF, NEG_INF, exp2f, fresh_shift, kahan_add, nan_max, packed_io, packed_max,
                      packed_pad, row_io, row_reductions, share_shift)
from ._glue import SIMULATOR, device_function, kernel, launch, vector_views
from ._intrinsics import LOG2E, vector_access

# Row elements per lane held in registers (a tile is 32x that), forward, and of each of y and dy, backward, by
# element size: the smallest choice whose tile holds the layout's mean row, else the largest. Each is rounded up
# to a whole number of vectors. Measured on an H200: forward, 16 was 1.3-1.9x faster than (16, 40, 64) and
# faster than 32 (tuning/blocksparse-floats-round2.txt); backward, (16, 32) took float32 from 0.70-0.74 of copy
# to 0.90-0.96 on the 25 % layouts and lost in bf16 (32 and 48 need 150-216 registers there).
FORWARD_FLOATS = {4: (16,), 2: (16,)}
BACKWARD_FLOATS = {4: (16, 32), 2: (16,)}
# 16-bit rows read in pairs are held as their words (two values a register, _device.packed_io), forward (positive
# scale) and backward, with these values per lane: the forward's as above (its causal kernel from "causal"), the
# backward's the most whose tile the mean row fills (else the fewest). Measured on an H200
# (tuning/numba-blocksparse-words-round1.txt), bf16 against floats: backward 0.64-0.81 -> 0.75-0.93, forward
# 0.60-0.68 -> 0.75-0.83 (causal 0.51-0.57 -> 0.56-0.72); 32 values against 48 on the causal layouts (forward
# 0.46-0.63 -> 0.56-0.72, backward 0.70-0.86 -> 0.75-0.89), 64 against 32 where the mean row is 2048 (backward
# 0.72-0.78 -> 0.87-0.90); 16 against 32 where the mean row is 460 (tuning/numba-blocksparse-short-rows-round1.txt:
# forward 0.58 -> 0.65, causal 0.50 -> 0.53, backward 0.80-0.82 -> 0.84-0.87), but 32 on the other causal layouts
# (16 lost 0.01-0.06).
PACK_16BIT = True
PACKED_VALUES = {"forward": (16, 32, 48, 64), "causal": (16, 32), "backward": (16, 32, 48, 64)}
# The forwards and the float backward keep the first tiles of rows longer than one tile in shared memory for their
# second pass, where they read them again: as many as the layout's STASH_ROW ("longest" or "mean") has but its
# last, in at most STASH_BYTES a block (dynamic shared memory: at most 48 KiB without an opt-in), the float
# backward at most BACKWARD_STASH_TILES (compiled in: see _backward_kernel). Measured on an H200
# (tuning/numba-blocksparse-stash-round2.txt), float32 against reading the tiles again: forward 0.70-0.86 ->
# 0.83-0.93 (the mean row; the longest row's stash lost on the causal layouts, 0.78-0.80 -> 0.72-0.77: fewer
# blocks a multiprocessor), backward 0.71-0.93 -> 0.83-0.98 (b16 25 % 0.96 -> 0.94); bf16 level but at 51 %
# causal (0.78 -> 0.83).
STASH_BYTES = 48 * 1024
STASH_ROW = "mean"
BACKWARD_STASH_TILES = 1
WARPS = 4              # warps per thread block on the GPU
# Lanes per row on the GPU, by direction: the power of two nearest the layout's mean row's bytes over
# ROW_LANE_BYTES (None: 32), at most 32 and at least 32 / B (a warp's rows within one block-row): fewer lanes spread
# a row's fixed costs (its set-up, its reductions) over more of its elements, several rows a warp. Measured on an
# H200 (tuning/numba-blocksparse-lanes.txt), against a warp a row: forward 128, bf16 0.53-0.87 -> 0.74-0.86 (11 %
# 0.65 -> 0.86, causal 0.53 -> 0.81; the causal 25 % layouts +0.07-0.09), float32 11 % 0.90 -> 0.93 (causal 0.81 ->
# 0.89), the rest level; backward 64, bf16 11 % 0.88 -> 0.94 (causal 0.85 -> 0.89), the rest level (128 lost 0.05-0.07
# on the bf16 b32-b128 layouts, 256 lost everywhere).
ROW_LANE_BYTES = {"forward": 128, "backward": 64}
# Blocks a multiprocessor the kernels are compiled for, by direction: b > 0, launch bounds (threads, b), a register
# budget of 65536 / (threads * b) a thread; 0, launch bounds (threads) alone, ptxas's own choice. Measured on an H200
# in session 29 (tuning/numba-blocksparse-bound-round1..2.txt), against 0: the bf16 forwards at b = 8 level (causal
# 0.005-0.013 lower), at 12 0.13-0.47 lower; the float32 backwards at b = 4 level (b16 +0.015, the rest within 0.01);
# b = 1 (no budget below 255 registers) 0.07-0.19 below b = 8 in the bf16 forwards, 0.03-0.07 below b = 4 in the
# float32 backwards.
BLOCKS_PER_SM = {"forward": 0, "backward": 0}
MAX_GRID = 1 << 20     # most thread blocks launched along the rows; more rows are walked grid-stride
MAX_GRID_Y = 65535     # most along the batch, the same
# The simulator runs a thread per lane and pays for every one and for every barrier: one
# lane per row by default (tests set more), few blocks, short tiles (rows of several tiles).
SIMULATOR_LANES = 1
SIMULATOR_GRID = 4
SIMULATOR_FLOATS = 4


def _jit(threads, direction):
    """cuda.jit for a `direction` kernel of `threads` threads a block (launch bounds), and for BLOCKS_PER_SM[direction]
    of them a multiprocessor where that is set (read when the kernel is built)."""
    if SIMULATOR:
        return cuda.jit
    blocks = BLOCKS_PER_SM[direction]
    return kernel(bound=(threads, blocks)) if blocks else cuda.jit(cache=True, launch_bounds=threads)


@device_function
def _row_place(z, row, offsets, nnz, log2b, log2v):
    """(first block of the row's block-row, the row's vector count, block-row g, row i in the block,
    vector offset of row i of the first block) for row (g, i) of batch entry z."""
    i = row & ((int64(1) << log2b) - 1)
    group = row >> log2b
    first = int64(offsets[group])
    n_vectors = (int64(offsets[group + 1]) - first) << log2v
    base = (((z * nnz + first) << log2b) + i) << log2v
    return first, n_vectors, group, i, base


@device_function
def _vector_at(base, v, log2b, log2v):
    """Index of vector v of the row whose first block's row starts at vector `base`."""
    return uint64(base + ((v >> log2v) << (log2b + log2v)) + (v & ((int64(1) << log2v) - 1)))


@device_function
def _causal_kept(causal, group, i, log2b):
    """Elements of row i of block-row `group` that the causal mask keeps, a prefix of the row (lut.causal)."""
    c = int64(causal[group])
    return ((c >> 1) << log2b) + (i + 1 if c & 1 else int64(0))


@functools.cache
def _stash_io(count, lanes):
    """(keep(saved, vals, at), fetch(saved, vals, at)): a lane's `count` values of a tile to or from its slots of
    a row's stash in shared memory, from `at` a lane apart (no bank conflicts). Only the lane reads back what it
    kept, so no barrier."""

    @device_function
    def keep(saved, vals, at):
        for k in range(count):
            saved[at + k * lanes] = vals[k]

    @device_function
    def fetch(saved, vals, at):
        for k in range(count):
            vals[k] = saved[at + k * lanes]

    return keep, fetch


@functools.cache
def _forward_kernel(fmt, width, causal, floats, lanes, warps):
    """The forward for element format `fmt` in vectors of `width`, `floats` values per lane
    (a multiple of width), `lanes` lanes per row, `warps` rows per block; scores in log2 units (c * x, c =
    scale * log2(e)), each term one ex2. The first `stash` tiles of a row longer than one are kept in shared
    memory (dynamic, `stash` tiles a row) by the first pass for the second, which reads only the others again."""
    vectors = floats // width
    tile = lanes * vectors
    held = lanes * floats   # a tile's values, a row
    read, write = row_io(fmt, width)
    keep, fetch = _stash_io(floats, lanes)
    merge_log2, _ = row_reductions(lanes)

    @device_function
    def load_scores(x, vals, base, t, lane, n_vectors, log2b, log2v, c):
        """vals = c * x over tile t (c = scale * log2(e): scores in log2 units); -inf past the row's end."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            at = k * width
            if v < n_vectors:
                read(x, _vector_at(base, v, log2b, log2v), vals, at)
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
                write(out, _vector_at(base, v, log2b, log2v), vals, k * width)

    @_jit(lanes * warps, "forward")
    def blocksparse_forward(x, out, offsets, causal_prefix, batch, rows, nnz, log2b, log2v, c, stash):
        lane = int64(cuda.threadIdx.x % lanes)
        vals = cuda.local.array(floats, float32)
        saved = cuda.shared.array(0, float32)
        slot = int64(cuda.threadIdx.x // lanes) * (stash * held) + lane   # the lane's first slot of the stash
        z = int64(cuda.blockIdx.y)
        while z < batch:
            row_id = int64(cuda.blockIdx.x) * warps + cuda.threadIdx.x // lanes
            while row_id < rows:
                first, n_vectors, group, i, base = _row_place(z, row_id, offsets, nnz, log2b, log2v)
                kept = _causal_kept(causal_prefix, group, i, log2b) if causal else int64(0)
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
                empty = row_m == NEG_INF   # every element masked or -inf: zeros
                inv_s = float32(0.0) if empty else float32(1.0) / row_s
                factor = float32(0.0) if empty or m == NEG_INF else exp2f(m - row_m) * inv_s
                # pass 2: the last tile from registers, the stashed ones from shared memory, the others read again
                # (zeros if the row is empty)
                if tiles > 0:
                    for k in range(floats):
                        vals[k] *= factor
                    store_tile(out, vals, base, tiles - 1, lane, n_vectors, log2b, log2v)
                for t in range(tiles - 1):
                    if empty:
                        for k in range(floats):
                            vals[k] = float32(0.0)
                    else:
                        if t < stash:
                            fetch(saved, vals, slot + t * held)
                        else:
                            load_scores(x, vals, base, t, lane, n_vectors, log2b, log2v, c)
                            if causal:
                                mask_past(vals, t, lane, kept)
                        for k in range(floats):
                            vals[k] = exp2f(vals[k] - row_m) * inv_s
                    store_tile(out, vals, base, t, lane, n_vectors, log2b, log2v)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_forward


@functools.cache
def _backward_kernel(fmt, width, floats, lanes, warps, stash=0):
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
    keep, fetch = _stash_io(floats, lanes)
    _, row_sum = row_reductions(lanes)

    @device_function
    def load_tile(y, dy, ys, gs, base, t, lane, n_vectors, log2b, log2v):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            at = k * width
            if v < n_vectors:
                place = _vector_at(base, v, log2b, log2v)
                read(y, place, ys, at)
                read(dy, place, gs, at)
            else:
                for j in range(width):
                    ys[at + j] = float32(0.0)
                    gs[at + j] = float32(0.0)

    @device_function
    def store_tile(dx, ys, gs, base, t, lane, n_vectors, log2b, log2v, dot, scale):
        """dx = scale * y * (dy - dot) over tile t (computed in gs)."""
        for k in range(floats):
            gs[k] = scale * ys[k] * (gs[k] - dot)
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                write(dx, _vector_at(base, v, log2b, log2v), gs, k * width)

    @_jit(lanes * warps, "backward")
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
                first, n_vectors, group, i, base = _row_place(z, row_id, offsets, nnz, log2b, log2v)
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
                if tiles > 0:
                    store_tile(dx, ys, gs, base, tiles - 1, lane, n_vectors, log2b, log2v, dot, scale)
                for t in range(tiles - 1):
                    if t < stash:
                        fetch(saved, ys, slot + 2 * t * held)
                        fetch(saved, gs, slot + (2 * t + 1) * held)
                    else:
                        load_tile(y, dy, ys, gs, base, t, lane, n_vectors, log2b, log2v)
                    store_tile(dx, ys, gs, base, t, lane, n_vectors, log2b, log2v, dot, scale)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_backward


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
                load_words(array, _vector_at(base, v, log2b, log2v), tmp)
                for j in range(count):
                    words[k * count + j] = tmp[j]
            else:
                for j in range(count):
                    words[k * count + j] = pad

    return load


@functools.cache
def _forward_packed_kernel(fmt, width, causal, values, lanes, warps):
    """The forward (scores in log2 units, as _forward_kernel's) for 16-bit rows read in pairs and a positive
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
    keep, fetch = _stash_io(held, lanes)
    merge_log2, _ = row_reductions(lanes)
    _, unpack = packed_io(fmt, width, vectors)
    _, write = row_io(fmt, width)
    pair_max, word_max = packed_max(fmt)
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
    def store_tile(out, words, vec, base, t, lane, n_vectors, log2b, log2v, c, row_m, inv_s, shift):
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                for j in range(width):
                    vec[j] = exp2f(unpack(words, k * width + j, shift) * c - row_m) * inv_s
                write(out, _vector_at(base, v, log2b, log2v), vec, 0)

    @device_function
    def store_zeros(out, vec, base, t, lane, n_vectors, log2b, log2v):
        for j in range(width):
            vec[j] = float32(0.0)
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                write(out, _vector_at(base, v, log2b, log2v), vec, 0)

    @_jit(lanes * warps, "forward")
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
                first, n_vectors, group, i, base = _row_place(z, row_id, offsets, nnz, log2b, log2v)
                read_vectors = n_vectors   # vectors read: those holding kept elements
                kept = int64(0)
                if causal:
                    kept = _causal_kept(causal_prefix, group, i, log2b)
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
                if row_m == NEG_INF:   # every element masked or -inf: zeros
                    for t in range(tiles):
                        store_zeros(out, vec, base, t, lane, n_vectors, log2b, log2v)
                else:
                    inv_s = float32(1.0) / row_s
                    # pass 2: the last tile from registers, the stashed ones from shared memory, the others read
                    # again
                    if tiles > 0:
                        store_tile(out, words, vec, base, tiles - 1, lane, n_vectors, log2b, log2v, c, row_m,
                                   inv_s, shift)
                    for t in range(tiles - 1):
                        if t < stash:
                            fetch(saved, words, slot + t * lanes * held)
                        else:
                            load(x, words, tmp, base, t, lane, read_vectors, log2b, log2v, pad)
                            if causal:
                                mask_past(words, t, lane, kept)
                        store_tile(out, words, vec, base, t, lane, n_vectors, log2b, log2v, c, row_m, inv_s,
                                   shift)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_forward_packed


@functools.cache
def _backward_packed_kernel(fmt, width, values, lanes, warps):
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
    def store_tile(dx, ys, gs, vec, base, t, lane, n_vectors, log2b, log2v, dot, scale, shift):
        """dx = scale * y * (dy - dot) over tile t."""
        for k in range(vectors):
            v = t * tile + k * lanes + lane
            if v < n_vectors:
                for j in range(width):
                    at = k * width + j
                    vec[j] = scale * unpack(ys, at, shift) * (unpack(gs, at, shift) - dot)
                write(dx, _vector_at(base, v, log2b, log2v), vec, 0)

    @_jit(lanes * warps, "backward")
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
                first, n_vectors, group, i, base = _row_place(z, row_id, offsets, nnz, log2b, log2v)
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
                if tiles > 0:
                    store_tile(dx, ys, gs, vec, base, tiles - 1, lane, n_vectors, log2b, log2v, dot, scale, shift)
                for t in range(tiles - 1):
                    load(y, ys, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    load(dy, gs, tmp, base, t, lane, n_vectors, log2b, log2v, int32(0))
                    store_tile(dx, ys, gs, vec, base, t, lane, n_vectors, log2b, log2v, dot, scale, shift)
                row_id += int64(cuda.gridDim.x) * warps
            z += int64(cuda.gridDim.y)

    return blocksparse_backward_packed


def _floats(choices, row: int, lanes: int, width: int, filled: bool = False) -> int:
    """Values per lane: among `choices`, each rounded up to a multiple of width, the fewest
    whose tile holds `row` elements, else the most; `filled`: the most whose tile `row`
    elements fill, else the fewest."""
    rounded = sorted({-(-floats // width) * width for floats in choices})
    if filled:
        return next((floats for floats in reversed(rounded) if floats * lanes <= row), rounded[0])
    return next((floats for floats in rounded if floats * lanes >= row), rounded[-1])


def _stash_tiles(lut, values: int, lanes: int, warps: int, size: int) -> int:
    """Tiles a row kept in shared memory for the layout of `lut`, `values` a lane, `size` bytes held per value."""
    blocks = lut.max_blocks if STASH_ROW == "longest" else lut.mean_blocks
    tile = lanes * values
    return max(0, min(math.ceil(blocks * lut.block / tile) - 1, STASH_BYTES // (warps * tile * size)))


def _packed(width: int, element_size: int) -> bool:
    """Whether 16-bit rows are held as their words: read in pairs (width >= 2) and PACK_16BIT."""
    return PACK_16BIT and element_size == 2 and width >= 2


def _row_lanes(row: float, element_size: int, block: int, direction: str) -> int:
    """Lanes per row on the GPU for rows of `row` elements on average (ROW_LANE_BYTES)."""
    per_lane = ROW_LANE_BYTES[direction]
    if per_lane is None:
        return 32
    share = max(1.0, row * element_size / per_lane)
    return max(32 // block, min(32, 1 << round(math.log2(share))))


def _launch_shape(batch: int, rows: int, row: float, width: int, element_size: int, block: int, direction: str,
                  positive_scale: bool = True, causal: bool = False):
    """(lanes per row, rows per thread block, grid, values per lane) of the `direction` kernel for `batch` times
    `rows` rows of `row` elements on average, of blocks of `block`, read in vectors of `width`; 16-bit rows held
    as words (_packed) take PACKED_VALUES, the forward only with a positive scale."""
    if SIMULATOR:
        floats = _floats((SIMULATOR_FLOATS,), row, SIMULATOR_LANES, width)
        return SIMULATOR_LANES, 1, (max(1, min(rows, SIMULATOR_GRID)), 1), floats
    lanes = _row_lanes(row, element_size, block, direction)
    per_block = WARPS * 32 // lanes
    grid = (max(1, min(-(-rows // per_block), MAX_GRID)), max(1, min(batch, MAX_GRID_Y)))
    if not _packed(width, element_size) or (direction == "forward" and not positive_scale):
        choices = FORWARD_FLOATS if direction == "forward" else BACKWARD_FLOATS
        return lanes, per_block, grid, _floats(choices[element_size], row, lanes, width)
    if direction == "backward":
        return lanes, per_block, grid, _floats(PACKED_VALUES["backward"], row, lanes, width, filled=True)
    return lanes, per_block, grid, _floats(PACKED_VALUES["causal" if causal else "forward"], row, lanes, width)


def _common(tensors, lut, direction, positive_scale=True, causal=False):
    """(element format, vector width (at most B: no vector crosses blocks), 1-D word views,
    launch shape of the `direction` kernel, sizes: batch, rows per batch entry, nnz, log2 B, log2 of the vectors
    per block row)."""
    fmt, width, views = vector_views(tuple(t.view(-1) for t in tensors), lut.block)
    batch = tensors[0].shape[0]
    rows = lut.heads * lut.block_rows * lut.block
    log2b = lut.block.bit_length() - 1
    sizes = (batch, rows, lut.nnz, log2b, log2b - (width.bit_length() - 1))
    shape = _launch_shape(batch, rows, lut.mean_blocks * lut.block, width, tensors[0].element_size(), lut.block,
                          direction, positive_scale, causal)
    return fmt, width, views, shape, tuple(numpy.int64(v) for v in sizes)


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    fmt, width, views, shape, (batch, rows, nnz, log2b, log2v) = _common((x, out), lut, "forward", scale > 0,
                                                                         is_causal)
    lanes, warps, grid, floats = shape
    # held as words, masked elements are -inf bits, which only a positive scale keeps -inf
    packed = _packed(width, x.element_size()) and scale > 0
    build = _forward_packed_kernel if packed else _forward_kernel
    size = 2 if packed else 4   # bytes held per value
    stash = _stash_tiles(lut, floats, lanes, warps, size)
    launch(build(fmt, width, bool(is_causal), floats, lanes, warps), grid, lanes * warps,
           (*views, lut.offsets, lut.causal, batch, rows, nnz, log2b, log2v, numpy.float32(scale * LOG2E),
            numpy.int64(stash)), shared=stash * warps * lanes * floats * size)


def backward(y, dy, dx, lut, scale: float) -> None:
    fmt, width, views, (lanes, warps, grid, floats), sizes = _common((y, dy, dx), lut, "backward")
    args = (*views, lut.offsets, *sizes, numpy.float32(scale))
    if _packed(width, y.element_size()):
        launch(_backward_packed_kernel(fmt, width, floats, lanes, warps), grid, lanes * warps, args)
        return
    stash = min(BACKWARD_STASH_TILES, _stash_tiles(lut, floats, lanes, warps, 8))   # y and dy
    launch(_backward_kernel(fmt, width, floats, lanes, warps, stash), grid, lanes * warps, args)
