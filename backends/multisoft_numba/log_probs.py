"""Per-token log-probabilities and entropy: each row's statistics in one read (forward), the gradient from them in one
read and one write (backward). backends/README.md, section log_probs.py, is the contract.

Both kernels hold each logit as h = tanh(x / softcap) with a softcap, else h = x, and take u = h * scale with scale =
softcap / temperature (or 1 / temperature): softcap first, then temperature; du/dx = (1 - h) (1 + h) / temperature
with a softcap, else 1 / temperature. The forward and the backward compute u the same way, so the backward's
exp(u - m) are the very terms the forward summed.

forward: a block per row reads the row once. Each thread keeps, over the elements it reads, the running max m of u,
S = sum exp(u - m) and A = sum exp(u - m) (u - m) relative to that max: when the max grows from m to m', S becomes
S e^(m - m') and A becomes e^(m - m') (A + (m - m') S). An element of u = -inf adds 0 to A (never 0 * -inf), and a
part whose max is -inf adds nothing. The block merges its threads' (m, S, A) the same way (_spread_merge) and writes
m, S and E = A / S. A NaN reaches m (a NaN-propagating max), and through m the rest.

The threads' share of a row, and so the order of every sum, is fixed by C, the dtype and the device alone (never by
the row count, the row's position or the tensor's alignment): the row is cut into chunks of `group` elements, the
widest vector of at most 16 bytes whose length divides C; chunk c belongs to thread c % threads, a thread takes
`count` chunks a step, and `threads` comes from C. The alignment of the data only decides how a chunk is loaded: as
one vector, or as several narrower ones (_launch.vector_views) holding the same elements in the same places.

backward: one elementwise sweep, no reduction. Block (x, y) takes vectors x * threads * vectors + tid, ... (`per_thread`
elements a thread) of rows y, y + gridDim.y, ...; each element's gradient depends only on its logit and its row's
(m, S, E, a, c) and ids, so the grid (which follows the row count) changes no result. With p = exp(u - m) / S:
du/dx (sum_k g_k [j == t_k] - p (a + c ((u - m) - E))), the p term computed as exp(u - m) (alpha + beta (u - m)),
alpha = (a - c E) / S and beta = c / S per row, and 0 where u = -inf. A thread adds the g_k of the ids that fall on
its own vectors, in k order; an id outside [0, C) is only compared, never used as an index. Each thread writes only
the vectors it has just read: the gradient may overwrite the logits.
"""

import functools
import math

import numpy
from numba import cuda, float32, uint64

from . import _tuning
from ._device import FULL_MASK, NEG_INF, expf, nan_max, row_io, strided_io, word_layout
from ._launch import MAX_THREADS, SIMULATOR, device_function, kernel, launch, threads_for, vector_views
from .cross_entropy import _softcap_for_kernel

# Shared-memory slots of the block merge: one a warp on the GPU; the simulator (no shuffles) gives each thread one.
MERGE_SLOTS = MAX_THREADS if SIMULATOR else 32


@device_function
def _spread_merge(m1, s1, a1, m2, s2, a2):
    """Merge two running (max m, S = sum exp(u - m), A = sum exp(u - m) (u - m)) triples: at the larger max m,
    S = S1 e^(m1 - m) + S2 e^(m2 - m) and A = e^(m1 - m) (A1 + (m1 - m) S1) + e^(m2 - m) (A2 + (m2 - m) S2). A triple
    whose max is -inf adds nothing; a NaN max wins (and makes S and A NaN)."""
    if m2 > m1 or m2 != m2:
        m1, s1, a1, m2, s2, a2 = m2, s2, a2, m1, s1, a1
    if m2 == NEG_INF:
        return m1, s1, a1
    shift = m2 - m1
    r = expf(shift)
    return m1, s1 + s2 * r, a1 + r * (a2 + shift * s2)


@device_function
def _warp_spread_merge(m, s, a):
    """_spread_merge over the 32 lanes of a warp by shuffles; every lane gets the warp's triple."""
    offset = 16
    while offset > 0:
        m, s, a = _spread_merge(m, s, a, cuda.shfl_xor_sync(FULL_MASK, m, offset),
                                cuda.shfl_xor_sync(FULL_MASK, s, offset), cuda.shfl_xor_sync(FULL_MASK, a, offset))
        offset //= 2
    return m, s, a


@device_function
def _block_spread_merge(buf_m, buf_s, buf_a, m, s, a):
    """Merge every thread's (m, S, A) (blockDim.x a multiple of 32 on the GPU; bufs of MERGE_SLOTS floats); every
    thread gets the block's. The GPU merges by shuffles within each warp, then the warps' triples; the simulator
    (no shuffles) merges the threads' triples in thread order. Either order is fixed by the block size."""
    tid = cuda.threadIdx.x
    if SIMULATOR:
        buf_m[tid] = m
        buf_s[tid] = s
        buf_a[tid] = a
        cuda.syncthreads()
        m = NEG_INF
        s = float32(0.0)
        a = float32(0.0)
        for k in range(cuda.blockDim.x):
            m, s, a = _spread_merge(m, s, a, buf_m[k], buf_s[k], buf_a[k])
        cuda.syncthreads()
        return m, s, a
    m, s, a = _warp_spread_merge(m, s, a)
    if tid % 32 == 0:
        buf_m[tid // 32] = m
        buf_s[tid // 32] = s
        buf_a[tid // 32] = a
    cuda.syncthreads()
    lane = tid % 32
    m = NEG_INF
    s = float32(0.0)
    a = float32(0.0)
    if lane < cuda.blockDim.x // 32:
        m = buf_m[lane]
        s = buf_s[lane]
        a = buf_a[lane]
    m, s, a = _warp_spread_merge(m, s, a)
    cuda.syncthreads()
    return m, s, a


@device_function
def _add_spread(m, s, a, vals):
    """Add the values u of the local array `vals` (padding -inf) to a thread's running (m, S, A): one rescale a
    call, then exp(u - m) into S and exp(u - m) (u - m) into A (nothing into A where u = -inf)."""
    top = NEG_INF
    for k in range(vals.shape[0]):
        top = nan_max(top, vals[k])
    if top > m or top != top:
        if m != NEG_INF:   # else S and A are 0 (and m - top may be NaN)
            shift = m - top
            r = expf(shift)
            a = r * (a + shift * s)
            s = s * r
        m = top
    if m != NEG_INF:
        for k in range(vals.shape[0]):
            d = vals[k] - m
            e = expf(d)
            s += e
            if d != NEG_INF:
                a += e * d
    return m, s, a


@functools.cache
def _chunk_loader(fmt, width, group, count, capped):
    """load(array, first, step, limit, vals, scale, inv_cap): u of the `count` chunks first, first + step, ... of a
    1-D word array (chunk c: elements [c * group, (c + 1) * group)) into vals (count * group floats), each chunk read
    as group // width vectors of `width` elements (_device.row_io); chunks at or past `limit` give -inf."""
    read, _ = row_io(fmt, width)
    vectors = group // width

    @device_function
    def load(array, first, step, limit, vals, scale, inv_cap):
        for k in range(count):
            c = first + k * step
            if c < limit:
                for v in range(vectors):
                    read(array, c * vectors + v, vals, k * group + v * width)
                for j in range(group):
                    h = vals[k * group + j]
                    if capped:
                        h = float32(math.tanh(h * inv_cap))
                    vals[k * group + j] = h * scale
            else:
                for j in range(group):
                    vals[k * group + j] = NEG_INF

    return load


@functools.cache
def _forward_kernel(fmt, width, group, count, capped):
    """The forward: a block a row, `count` chunks of `group` elements a thread a step (module docstring). Arguments:
    x (word view of (M, C)), row_stats (3, M), scale, inv_cap (0 without a softcap)."""
    load = _chunk_loader(fmt, width, group, count, capped)
    chunk_words = (group // width) * word_layout(fmt, width)[1]
    per_thread = group * count   # a compile-time constant for the local array

    @kernel
    def forward(x, row_stats, scale, inv_cap):
        row = cuda.blockIdx.x
        x_row = x[uint64(row)]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_chunks = x.shape[1] // chunk_words
        buf_m = cuda.shared.array(MERGE_SLOTS, float32)
        buf_s = cuda.shared.array(MERGE_SLOTS, float32)
        buf_a = cuda.shared.array(MERGE_SLOTS, float32)
        vals = cuda.local.array(per_thread, float32)
        m = NEG_INF
        s = float32(0.0)
        a = float32(0.0)
        for base in range(tid, n_chunks, threads * count):
            load(x_row, base, threads, n_chunks, vals, scale, inv_cap)
            m, s, a = _add_spread(m, s, a, vals)
        m, s, a = _block_spread_merge(buf_m, buf_s, buf_a, m, s, a)
        if tid == 0:
            row_stats[0, row] = m
            row_stats[1, row] = s
            row_stats[2, row] = a / s

    return forward


@functools.cache
def _backward_kernel(fmt, width, per_thread, capped):
    """The backward's elementwise sweep (module docstring). Arguments: x, grad (word views of (M, C), possibly of the
    same memory), target (M, K) int64 or int32, row_stats (3, M), grad_target (M, K), row_coefficients (2, M), scale,
    inv_cap (0 without a softcap), inv_temperature."""
    vectors = per_thread // width
    read_vectors, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]
    slope_slots = per_thread if capped else 1

    @kernel
    def backward(x, target, row_stats, grad_target, row_coefficients, grad, scale, inv_cap, inv_temperature):
        rows = target.shape[0]
        ids = target.shape[1]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        classes = n_vectors * width
        first = cuda.blockIdx.x * threads * vectors + tid
        vals = cuda.local.array(per_thread, float32)
        slopes = cuda.local.array(slope_slots, float32)   # du/dx of each value, with a softcap
        for row in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
            m = row_stats[0, row]
            s = row_stats[1, row]
            spread = row_stats[2, row]
            at_entropy = row_coefficients[1, row]
            alpha = (row_coefficients[0, row] - at_entropy * spread) / s   # of exp(u - m)
            beta = at_entropy / s                                          # of exp(u - m) (u - m)
            read_vectors(x[uint64(row)], first, threads, n_vectors, vals, float32(0.0))
            for k in range(per_thread):
                h = vals[k]
                if capped:
                    h = float32(math.tanh(h * inv_cap))
                    slopes[k] = (float32(1.0) - h) * (float32(1.0) + h) * inv_temperature
                d = h * scale - m
                value = float32(0.0)
                if d != NEG_INF:   # the p term is 0 where u = -inf
                    value = -(expf(d) * (alpha + beta * d))
                vals[k] = value
            for i in range(ids):
                t = target[row, i]
                if t >= 0 and t < classes:
                    hit = t // width   # the vector holding t; this thread's are first, first + threads, ...
                    at = t - hit * width
                    for v in range(vectors):
                        if first + v * threads == hit:
                            g = grad_target[row, i]
                            # every value of the vector gets a term, 0 but at t: an add only at t would become a store
                            # at a computed index, which moves vals from registers to local memory
                            for j in range(width):
                                vals[v * width + j] += g if j == at else float32(0.0)
            for k in range(per_thread):   # du/dx
                if capped:
                    vals[k] *= slopes[k]
                else:
                    vals[k] *= inv_temperature
            write_vectors(grad[uint64(row)], first, threads, n_vectors, vals)

    return backward


def _chunk_elements(classes: int, element_size: int) -> int:
    """The elements of a forward chunk: the widest vector of at most 16 bytes whose length (a power of two) divides
    C. It depends on C and the dtype only; the alignment of the data decides only how a chunk is loaded."""
    group = 16 // element_size
    while classes % group:
        group //= 2
    return group


def _scales(options) -> tuple:
    """(capped, scale, inv_cap, inv_temperature) as the kernels take them: u = h * scale, h = tanh(x * inv_cap) when
    capped (a softcap beyond float32's range is none, as cross-entropy's), else h = x."""
    softcap = _softcap_for_kernel(options.softcap)
    inv_temperature = 1.0 / options.temperature
    if softcap:
        return True, numpy.float32(softcap * inv_temperature), numpy.float32(1.0 / softcap), \
            numpy.float32(inv_temperature)
    return False, numpy.float32(inv_temperature), numpy.float32(0.0), numpy.float32(inv_temperature)


def forward(logits, row_stats, options) -> None:
    """row_stats[:, i] = (m, S, E) of row i: the max of u, sum exp(u - m) and sum exp(u - m) (u - m) / S."""
    rows, classes = logits.shape
    group = _chunk_elements(classes, logits.element_size())
    fmt, width, (logit_words,) = vector_views((logits,), max_width=group)
    count = max(1, _tuning.LP_UNROLL // group)
    threads = min(_tuning.LP_FORWARD_THREADS, threads_for(classes, _tuning.LP_STEPS * group * count))
    capped, scale, inv_cap, _ = _scales(options)
    launch(_forward_kernel(fmt, width, group, count, capped), rows, threads, (logit_words, row_stats, scale, inv_cap))


def backward(logits, target, row_stats, grad_target, row_coefficients, grad_logits, options) -> None:
    """grad_logits[i, j] = du_j/dx_j (sum_k g_ik [j == t_ik] - p_j (a_i + c_i ((u_j - m_i) - E_i))), the p term 0
    where u_j = -inf; grad_logits may be logits itself."""
    rows, classes = logits.shape
    fmt, width, (logit_words, grad_words) = vector_views((logits, grad_logits))
    per_thread = max(_tuning.LP_BACKWARD_UNROLL, width)
    threads = min(_tuning.LP_BACKWARD_THREADS, threads_for(classes, per_thread))
    chunks = -(-(classes // width) // (threads * (per_thread // width)))
    capped, scale, inv_cap, inv_temperature = _scales(options)
    launch(_backward_kernel(fmt, width, per_thread, capped), (chunks, min(rows, _tuning.LP_BACKWARD_ROW_BLOCKS)),
           threads, (logit_words, target, row_stats, grad_target, row_coefficients, grad_words, scale, inv_cap,
                     inv_temperature))
