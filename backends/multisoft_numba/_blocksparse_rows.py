"""What the block-sparse kernels (_blocksparse_float, _blocksparse_packed) share: where a row lies in the compressed
blocks, its causal prefix, its non-finite cases, the stash of its tiles in shared memory, and the jit options.
"""

import functools
import math

from numba import cuda, float32, int64, uint64

from ._device import NEG_INF, row_io
from ._launch import SIMULATOR, device_function


def jit_for(threads):
    """cuda.jit for a kernel of blocks of `threads` threads (its launch bounds; the compiler picks the registers),
    cached on disk."""
    if SIMULATOR:
        return cuda.jit
    return cuda.jit(cache=True, launch_bounds=threads)


@device_function
def row_place(z, row, offsets, nnz, log2b, log2v):
    """(first block of the row's block-row, the row's vector count, block-row g, row i in the block,
    vector offset of row i of the first block) for row (g, i) of batch entry z."""
    i = row & ((int64(1) << log2b) - 1)
    group = row >> log2b
    first = int64(offsets[group])
    n_vectors = (int64(offsets[group + 1]) - first) << log2v
    base = (((z * nnz + first) << log2b) + i) << log2v
    return first, n_vectors, group, i, base


INF = float32(math.inf)
ZERO = float32(0.0)


@device_function
def shift_of(row_m):
    """The shift of a row's scores: its max, or 0 where that is -inf (every score -inf: 2**(-inf - 0) = 0, and the
    sum's 1 / 0 gives the 0 * inf = NaN of dense softmax), never guarded for a max of +inf or NaN."""
    return ZERO if row_m == NEG_INF else row_m


@device_function
def not_finite(v):
    """Whether v is NaN or infinite: a row's dot of y and dy that makes scale * y * (dy - dot) NaN where y is 0
    (a NaN or infinite dy at such an element makes the dot NaN too), so that the backward selects 0 there; in other
    rows that product is 0 already."""
    return not abs(v) < INF


@device_function
def nan_row(row_m, row_s):
    """Whether a row's softmax is NaN throughout (a NaN or +inf max, a max of -inf in a row with an unmasked
    element, a NaN sum): then its masked elements' terms are NaN too, not 0, and are set to 0."""
    return not (abs(row_m) < INF and row_s == row_s)


@device_function
def vector_at(base, v, log2b, log2v):
    """Index of vector v of the row whose first block's row starts at vector `base`."""
    return uint64(base + ((v >> log2v) << (log2b + log2v)) + (v & ((int64(1) << log2v) - 1)))


@device_function
def causal_kept(causal, group, i, log2b):
    """Elements of row i of block-row `group` that the causal mask keeps, a prefix of the row (lut.causal)."""
    c = int64(causal[group])
    return ((c >> 1) << log2b) + (i + 1 if c & 1 else int64(0))


@functools.cache
def stash_io(count, lanes):
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
def zero_past_writer(fmt, width, lanes):
    """zero_past(out, vals, base, lane, n_vectors, kept, log2b, log2v): 0 for the elements of the lane's vectors
    of a written row past its first `kept` (vals: `width` floats of scratch; the vector the diagonal cuts is read
    back). For causal rows that come out NaN, whose masked elements' terms are NaN too: a pass of its own, so that
    the forwards' loops stay as they are for the other rows."""
    read, write = row_io(fmt, width)

    @device_function
    def zero_past(out, vals, base, lane, n_vectors, kept, log2b, log2v):
        v = kept // width
        v += (lane - v) % lanes   # the lane's first vector from there
        while v < n_vectors:
            place = vector_at(base, v, log2b, log2v)
            if v * width < kept:
                read(out, place, vals, 0)
            for j in range(width):
                if v * width + j >= kept:
                    vals[j] = ZERO
            write(out, place, vals, 0)
            v += lanes

    return zero_past
