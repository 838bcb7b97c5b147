"""The kernel of cross-entropy with class-probability targets: a block per row.

A thread keeps, over the elements it reads, the running max m and sum S of exp(u - m) of the capped logits
u = softcap * tanh(x / softcap) (or u = x), the weighted target mass A = sum w_c q_c (q = (1 - eps) * target +
eps / C, w = weight or 1) and D = sum w_c q_c (m - u_c) relative to its running max: when the max grows by d, D
grows by A * d. The block merges (m, S), moves each thread's D to the block's max the same way and sums D and A:
loss = D + A * log S + z * lse**2, kept in that form (exact where lse rounded to float32 is not). A logit of -inf
adds w q * inf to D (NaN where w q is 0, as torch's 0 * -inf), never w q * (m - u) with a max of -inf so far.

With a gradient buffer the row is swept again, writing grad_scale * du/dx * (p * (A + 2 z lse) - w q) with
p = exp(u - m) / S from the block's own m and S: from the logits and w q its threads hold when the row fits
("cached"), else re-reading both from the row's last part back, which the block read most recently ("looping").
"""

import functools
import math

from numba import cuda, float32, uint64

from ._device import NAN, NEG_INF, block_online_merge, block_sum, expf, logf, nan_max, strided_io, word_layout
from ._launch import MAX_THREADS, device_function, kernel

POS_INF = float32(math.inf)


@functools.cache
def _row_functions(fmt, width, count, has_weight, capped):
    """Per-thread pieces for `count` vectors of `width` elements at first, first + step, ... of a row (vectors at
    or past `limit` are padding), each logit held as v = tanh(x / softcap) with a softcap (u = softcap * v and
    du/dx = (1 - v) * (1 + v) both come from it), else as v = x, each target as its w q:

    load(logits, targets, weight, first, step, limit, vals, mass, keep, per_class, inv_cap): vals (padding -inf)
        and mass (padding 0) of the row's vectors;
    logit(v, cap): u of a held value;
    sweep(..., cap, m, s, a, d): load, then the running (m, S, A, D) with these elements added;
    gradient(vals, mass, first, step, limit, cap, m, coef_p, g): held values -> the gradient
        (coef_p * exp(u - m) - g * w q) * du/dx, into vals.
    """
    read_vectors, _ = strided_io(fmt, width, count)

    @device_function
    def load(logits, targets, weight, first, step, limit, vals, mass, keep, per_class, inv_cap):
        read_vectors(logits, first, step, limit, vals, NEG_INF)
        read_vectors(targets, first, step, limit, mass, float32(0.0))
        for k in range(count):
            c = first + k * step
            if c < limit:
                for j in range(width):
                    at = k * width + j
                    if capped:
                        vals[at] = float32(math.tanh(vals[at] * inv_cap))
                    q = keep * mass[at] + per_class
                    mass[at] = q * weight[c * width + j] if has_weight else q

    @device_function
    def logit(v, cap):
        return cap * v if capped else v

    @device_function
    def add_stats(vals, mass, first, step, limit, cap, m, s, a, d):
        top = NEG_INF
        for k in range(count * width):
            top = nan_max(top, vals[k])
        top = logit(top, cap)   # u grows with v
        if top > m or top != top:
            s = s * expf(m - top)
            if m != NEG_INF:
                d += a * (top - m)
            m = top
        for k in range(count):
            if first + k * step < limit:
                for j in range(width):
                    at = k * width + j
                    u = logit(vals[at], cap)
                    if m != NEG_INF:
                        s += expf(u - m)
                    a += mass[at]
                    d += mass[at] * (POS_INF if u == NEG_INF else m - u)
        return m, s, a, d

    @device_function
    def sweep(logits, targets, weight, first, step, limit, vals, mass, keep, per_class, cap, inv_cap, m, s, a, d):
        load(logits, targets, weight, first, step, limit, vals, mass, keep, per_class, inv_cap)
        return add_stats(vals, mass, first, step, limit, cap, m, s, a, d)

    @device_function
    def gradient(vals, mass, first, step, limit, cap, m, coef_p, g):
        for k in range(count):
            if first + k * step < limit:
                for j in range(width):
                    at = k * width + j
                    v = vals[at]
                    value = coef_p * expf(logit(v, cap) - m) - g * mass[at]
                    if capped:
                        value *= (float32(1.0) - v) * (float32(1.0) + v)
                    vals[at] = value

    return load, sweep, gradient


@functools.cache
def probabilities_kernel(fmt, width, per_thread, cached, has_weight, capped, with_grad):
    """The kernel: a thread holds `per_thread` logits and as many w q of its row (cached: the whole row is held at
    once) or reads that many a step (looping); `with_grad`: it writes the gradient row too.

    Arguments: logits, target (word views of (M, C)), weight (C,) (any float32 array without a weight), loss,
    lse (M,), grad (word view of (M, C)), grad_scale, scale_stride (0: one value for every row), keep = 1 - eps,
    per_class = eps / C, cap, inv_cap (0 without a softcap), z_scale."""
    vectors = per_thread // width
    _, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]
    load, sweep, gradient = _row_functions(fmt, width, vectors, has_weight, capped)

    @kernel
    def forward(x, target, weight, loss, lse, grad, grad_scale, scale_stride, keep, per_class, cap, inv_cap,
                z_scale):
        row = cuda.blockIdx.x
        x_row = x[uint64(row)]
        t_row = target[uint64(row)]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        step = threads * vectors
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(per_thread, float32)
        mass = cuda.local.array(per_thread, float32)
        m = NEG_INF
        s = float32(0.0)
        a = float32(0.0)   # sum w q
        d = float32(0.0)   # sum w q (m - u), relative to this thread's m
        if cached:
            m, s, a, d = sweep(x_row, t_row, weight, tid, threads, n_vectors, vals, mass, keep, per_class, cap,
                               inv_cap, m, s, a, d)
        else:
            for base in range(tid, n_vectors, step):
                m, s, a, d = sweep(x_row, t_row, weight, base, threads, n_vectors, vals, mass, keep, per_class, cap,
                                   inv_cap, m, s, a, d)
        row_m, s = block_online_merge(buf_m, buf_s, m, s)
        if m != NEG_INF:
            d += a * (row_m - m)
        d = block_sum(buf_s, d)
        a = block_sum(buf_m, a)
        m = row_m
        log_s = logf(s)
        row_lse = m if m == POS_INF else m + log_s   # torch's logsumexp: inf where a logit is
        if tid == 0:
            lse[row] = row_lse
            value = NAN   # a row of -inf: torch's log_softmax is NaN throughout
            if m != NEG_INF:
                value = d + a * log_s
                if z_scale != float32(0.0):
                    value += z_scale * row_lse * row_lse
            loss[row] = value
        if with_grad:
            grad_row = grad[uint64(row)]
            g = grad_scale[row * scale_stride]
            total = a
            if z_scale != float32(0.0):
                total += float32(2.0) * z_scale * row_lse
            coef_p = g * total / s   # of exp(u - m)
            if cached:
                gradient(vals, mass, tid, threads, n_vectors, cap, m, coef_p, g)
                write_vectors(grad_row, tid, threads, n_vectors, vals)
            else:
                steps = (n_vectors + step - 1) // step
                for back in range(steps):   # the last part first: the part read last, most likely still in L2
                    base = tid + (steps - 1 - back) * step
                    load(x_row, t_row, weight, base, threads, n_vectors, vals, mass, keep, per_class, inv_cap)
                    gradient(vals, mass, base, threads, n_vectors, cap, m, coef_p, g)
                    write_vectors(grad_row, base, threads, n_vectors, vals)

    return forward
