"""Cross-entropy with class-index targets in one kernel, and the backward's scaling of the gradient it wrote.

forward: a block per row reads the row once for its statistics (the running max m and sum S of exp(u - m) of the
capped logits u = softcap * tanh(x / softcap), or u = x; the target's u; with label smoothing the weighted sum of u
and of the weights), writes loss, lse and row weight, and, when a gradient buffer is given, sweeps the row again
writing grad_scale[i] * dloss_i / dx: from the values its threads hold in registers when the row fits ("cached"),
else re-reading the row from its last part back, which the block read most recently and L2 likely still holds
("looping"). p is exp(u - m) / S from the block's own m and S, not exp(u - lse) with lse rounded to float32. Every
read of a row comes before the barrier that ends the first sweep, and in the second sweep a thread writes only the
vectors it has just read itself: the gradient may overwrite the logits (in place).

With a row_stats buffer (a separate kernel, with_stats) the forward also writes each row's m, S and sum_c w_c u_c:
the statistics of a slice of the classes, which the front combines across ranks (vocabulary-parallel cross-entropy).

gradient: that slice's gradient from the whole row's statistics, (a * exp(u - m) / S - b * [c == t] - c_ * w_c) *
du/dx: one elementwise sweep with no reduction, so a long row is shared among several blocks, as scale shares it.

probabilities_forward: class-probability targets (_cross_entropy_probabilities: the same row mapping and two sweeps).

scale: grad *= factor, one factor (read on the device: when it is 1 every block returns at once) or one a row.

A target outside [0, C) that is not ignore_index is never used as an index: its loss is NaN and its gradient row
NaN. Kernels are built per element format and vector width (_device.row_io), elements a thread holds or reads a
step, and the compile-time options (path, label smoothing, weight, softcap, gradient); rows are read and written a
vector at a time through one-row views indexed with unsigned integers (no negative-index wraparound code).
"""

import functools
import math

import numpy
from numba import cuda, float32, uint64

from . import _tuning
from ._cross_entropy_probabilities import POS_INF, probabilities_kernel
from ._device import (NAN, NEG_INF, block_online_merge, block_sum, expf, kahan_add, logf, nan_max, strided_io,
                      word_layout)
from ._launch import (MAX_THREADS, SIMULATOR, device_function, device_index, kernel, launch, multiprocessors,
                      threads_for, vector_views)

_FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


@functools.cache
def _row_functions(fmt, width, count, smooth, has_weight, capped):
    """Per-thread pieces of the forward kernel for `count` vectors of `width` elements at first, first + step, ...
    of a row (vectors at or past `limit` are padding), holding each element as v = tanh(x / softcap) with a softcap
    (so that both u = softcap * v and du/dx = (1 - v) * (1 + v) come from it), else as v = x:

    load(row, first, step, limit, vals, inv_cap): the held values of the row's vectors into vals (padding -inf);
    logit(v, cap): u of a held value;
    sweep(row, weight, first, step, limit, vals, cap, inv_cap, m, s, total, lost, weight_total): load, then the
        running (max, sum of exp(u - m)) and, with label smoothing, sum of w_c * u_c (compensated: total, lost)
        and of w_c (w = 1 without a weight) with these values added;
    gradient(vals, weight, first, step, limit, cap, m, coef_p, t, coef_t, coef_w): held values -> the gradient
        (coef_p * exp(u - m) - coef_t * [c == t] - coef_w * w_c) * du/dx, in place.
    """
    read_vectors, _ = strided_io(fmt, width, count)

    @device_function
    def load(row, first, step, limit, vals, inv_cap):
        read_vectors(row, first, step, limit, vals, NEG_INF)
        if capped:
            for k in range(count):
                if first + k * step < limit:
                    for j in range(width):
                        vals[k * width + j] = float32(math.tanh(vals[k * width + j] * inv_cap))

    @device_function
    def logit(v, cap):
        return cap * v if capped else v

    @device_function
    def add_stats(vals, m, s, cap):
        top = NEG_INF
        for k in range(count * width):
            top = nan_max(top, vals[k])
        top = logit(top, cap)   # u grows with v
        if top > m or top != top:
            s = s * expf(m - top)
            m = top
        if m != NEG_INF:
            for k in range(count * width):
                s += expf(logit(vals[k], cap) - m)
        return m, s

    @device_function
    def add_smoothing(vals, weight, first, step, limit, cap, total, lost, weight_total):
        for k in range(count):
            c = first + k * step
            if c < limit:
                for j in range(width):
                    u = logit(vals[k * width + j], cap)
                    if has_weight:
                        w = weight[c * width + j]
                        total, lost = kahan_add(total, lost, w * u)
                        weight_total += w
                    else:
                        total, lost = kahan_add(total, lost, u)
        return total, lost, weight_total

    @device_function
    def sweep(row, weight, first, step, limit, vals, cap, inv_cap, m, s, total, lost, weight_total):
        load(row, first, step, limit, vals, inv_cap)
        m, s = add_stats(vals, m, s, cap)
        if smooth:
            total, lost, weight_total = add_smoothing(vals, weight, first, step, limit, cap, total, lost,
                                                      weight_total)
        return m, s, total, lost, weight_total

    @device_function
    def gradient(vals, weight, first, step, limit, cap, m, coef_p, t, coef_t, coef_w):
        for k in range(count):
            c = first + k * step
            if c < limit:
                for j in range(width):
                    v = vals[k * width + j]
                    col = c * width + j
                    value = coef_p * expf(logit(v, cap) - m)
                    if col == t:
                        value -= coef_t
                    if smooth:
                        value -= coef_w * (weight[col] if has_weight else float32(1.0))
                    if capped:
                        value *= (float32(1.0) - v) * (float32(1.0) + v)
                    vals[k * width + j] = value

    return load, logit, sweep, gradient


@functools.cache
def _forward(fmt, width, per_thread, cached, smooth, has_weight, capped, with_grad, with_stats):
    """The forward kernel: a thread holds `per_thread` elements of its row (cached: the whole row is held at once)
    or reads that many a step (looping); `with_grad`: it writes the gradient row too; `with_stats`: row_stats, (3, M)
    flattened, gets each row's m, S and sum_c w_c u_c."""
    vectors = per_thread // width
    _, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]
    load, logit, sweep, gradient = _row_functions(fmt, width, vectors, smooth, has_weight, capped)
    load_one = _row_functions(fmt, width, 1, False, False, capped)[0]

    @kernel
    def forward(x, target, weight, loss, lse, row_weight, grad, grad_scale, scale_stride, row_stats, ignore_index,
                eps, cap, inv_cap, z_scale):
        row = cuda.blockIdx.x
        x_row = x[uint64(row)]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        n = n_vectors * width
        step = threads * vectors
        t = target[row]
        ignored = t == ignore_index
        valid = not ignored and t >= 0 and t < n
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(per_thread, float32)
        target_vals = cuda.local.array(width, float32)
        u_t = float32(0.0)
        if tid == 0 and valid:   # read with the rest of the row, before the barrier
            load_one(x_row, t // width, 1, t // width + 1, target_vals, inv_cap)
            u_t = target_vals[0]
            for j in range(1, width):
                if t % width == j:
                    u_t = target_vals[j]
            u_t = logit(u_t, cap)
        m = NEG_INF
        s = float32(0.0)
        weighted_u = float32(0.0)   # sum_c w[c] * u[c], for label smoothing
        lost = float32(0.0)
        weight_total = float32(0.0)
        if cached:
            m, s, weighted_u, lost, weight_total = sweep(x_row, weight, tid, threads, n_vectors, vals, cap, inv_cap,
                                                         m, s, weighted_u, lost, weight_total)
        else:
            for base in range(tid, n_vectors, step):
                m, s, weighted_u, lost, weight_total = sweep(x_row, weight, base, threads, n_vectors, vals, cap,
                                                             inv_cap, m, s, weighted_u, lost, weight_total)
        m, s = block_online_merge(buf_m, buf_s, m, s)
        if smooth:
            weighted_u = block_sum(buf_s, weighted_u - lost)
            weight_total = block_sum(buf_s, weight_total) if has_weight else float32(n)
        row_lse = m + logf(s)
        w_t = float32(0.0)
        if valid:
            w_t = weight[t] if has_weight else float32(1.0)
        if tid == 0:
            # torch's logsumexp: inf where a logit is (s is NaN then); the loss keeps row_lse, NaN as torch's is
            lse[row] = m if m == POS_INF else row_lse
            row_weight[row] = w_t
            value = float32(0.0) if ignored else NAN
            if valid:
                value = (float32(1.0) - eps) * w_t * (row_lse - u_t)
                if smooth:
                    value += eps / float32(n) * (weight_total * row_lse - weighted_u)
                if z_scale != float32(0.0):
                    value += z_scale * row_lse * row_lse
            loss[row] = value
            if with_stats:
                rows = loss.shape[0]
                row_stats[row] = m
                row_stats[rows + row] = s
                row_stats[2 * rows + row] = weighted_u
        if with_grad:
            grad_row = grad[uint64(row)]
            steps = (n_vectors + step - 1) // step
            if not valid:
                for k in range(per_thread):
                    vals[k] = float32(0.0) if ignored else NAN
                for back in range(steps):
                    write_vectors(grad_row, tid + back * step, threads, n_vectors, vals)
                return
            g = grad_scale[row * scale_stride]
            coef_t = g * (float32(1.0) - eps) * w_t      # of [c == t]
            coef_w = g * eps / float32(n)                # of w[c]
            total = (float32(1.0) - eps) * w_t
            if smooth:
                total += eps / float32(n) * weight_total
            if z_scale != float32(0.0):
                total += float32(2.0) * z_scale * row_lse
            coef_p = g * total / s                       # of exp(u - m)
            if cached:
                gradient(vals, weight, tid, threads, n_vectors, cap, m, coef_p, t, coef_t, coef_w)
                write_vectors(grad_row, tid, threads, n_vectors, vals)
            else:
                for back in range(steps):   # the last part first: the part read last, most likely still in L2
                    base = tid + (steps - 1 - back) * step
                    load(x_row, base, threads, n_vectors, vals, inv_cap)
                    gradient(vals, weight, base, threads, n_vectors, cap, m, coef_p, t, coef_t, coef_w)
                    write_vectors(grad_row, base, threads, n_vectors, vals)

    return forward


@functools.cache
def _scale(fmt, width, per_thread):
    vectors = per_thread // width
    read_vectors, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]

    @kernel
    def scale(grad, factor, factor_stride):
        if factor_stride == 0 and factor[0] == float32(1.0):
            return
        tid = cuda.threadIdx.x
        n_vectors = grad.shape[1] // words
        first = cuda.blockIdx.x * cuda.blockDim.x * vectors + tid
        vals = cuda.local.array(per_thread, float32)
        for row in range(cuda.blockIdx.y, grad.shape[0], cuda.gridDim.y):
            f = factor[row * factor_stride]
            if f != float32(1.0):
                grad_row = grad[uint64(row)]
                read_vectors(grad_row, first, cuda.blockDim.x, n_vectors, vals, float32(0.0))
                for k in range(per_thread):
                    vals[k] *= f
                write_vectors(grad_row, first, cuda.blockDim.x, n_vectors, vals)

    return scale


@functools.cache
def _gradient(fmt, width, per_thread, has_weight, capped):
    """The gradient kernel: block (x, y) writes vectors x * threads * vectors + tid, ... (`per_thread` elements a
    thread) of rows y, y + gridDim.y, ...; each thread writes only the vectors it has just read (in place allowed).
    row_max_sum (2, M) and coefficients (3, M) come flattened."""
    vectors = per_thread // width
    read_vectors, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]

    @kernel
    def gradient(x, target, weight, row_max_sum, coefficients, grad, cap, inv_cap):
        rows = target.shape[0]
        tid = cuda.threadIdx.x
        n_vectors = x.shape[1] // words
        first = cuda.blockIdx.x * cuda.blockDim.x * vectors + tid
        vals = cuda.local.array(per_thread, float32)
        for row in range(cuda.blockIdx.y, rows, cuda.gridDim.y):
            t = target[row]
            m = row_max_sum[row]
            coef_p = coefficients[row] / row_max_sum[rows + row]
            coef_t = coefficients[rows + row]
            coef_w = coefficients[2 * rows + row]
            grad_row = grad[uint64(row)]
            read_vectors(x[uint64(row)], first, cuda.blockDim.x, n_vectors, vals, float32(0.0))
            for k in range(vectors):
                c = first + k * cuda.blockDim.x
                for j in range(width):
                    col = c * width + j
                    v = vals[k * width + j]
                    if capped:
                        v = float32(math.tanh(v * inv_cap))
                        value = coef_p * expf(cap * v - m)
                    else:
                        value = coef_p * expf(v - m)
                    if col == t:
                        value -= coef_t
                    if has_weight:
                        value -= coef_w * (weight[col] if c < n_vectors else float32(0.0))
                    else:
                        value -= coef_w
                    if capped:
                        value *= (float32(1.0) - v) * (float32(1.0) + v)
                    vals[k * width + j] = value
            write_vectors(grad_row, first, cuda.blockDim.x, n_vectors, vals)

    return gradient


def _softcap_for_kernel(softcap: float) -> float:
    """0 (no cap) for no softcap, and for one beyond float32's range too (softcap * tanh(x / softcap) then rounds
    to x for every float32 x)."""
    return float(softcap) if 0.0 < softcap <= _FLOAT32_MAX else 0.0


def _per_row(values):
    """(values as the kernels take them, row stride): a stride-0 broadcast or a single value as its one element
    (stride 0), else contiguous (stride 1)."""
    if values.numel() == 1 or values.stride(0) == 0:
        return values[:1], 0
    return values.contiguous(), 1


def forward(logits, target, weight, loss, lse, row_weight, grad_logits, grad_scale, options, row_stats=None) -> None:
    """loss, lse and row_weight of every row; with grad_logits (possibly logits itself) its gradient row too,
    grad_scale[i] * dloss_i / dlogits; with row_stats (3, M) each row's m, S and sum_c w_c u_c (0 without label
    smoothing)."""
    ignore_index, label_smoothing = options.ignore_index, options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    rows, classes = logits.shape
    with_grad = grad_logits is not None
    fmt, width, views = vector_views((logits, grad_logits) if with_grad else (logits,))
    logit_words = views[0]
    cache = max(_tuning.CE_CACHE, width)
    cached = with_grad and classes <= min(_tuning.CE_CACHED_THREADS, MAX_THREADS) * cache
    if cached:
        per_thread, threads = cache, threads_for(classes, cache)
    else:
        per_thread, threads = max(_tuning.CE_UNROLL, width), threads_for(classes, 4 * _tuning.CE_UNROLL)
    softcap = _softcap_for_kernel(softcap)
    if with_grad:
        grad_words = views[1]
        grad_scale, scale_stride = _per_row(grad_scale)
    else:   # never read: placeholders of the right kinds
        grad_words, grad_scale, scale_stride = logit_words, loss, 0
    eps = numpy.float32(label_smoothing)
    with_stats = row_stats is not None
    kernel_ = _forward(fmt, width, per_thread, cached, bool(eps), weight is not None, softcap != 0.0, with_grad,
                       with_stats)
    launch(kernel_, rows, threads,
           (logit_words, target, weight if weight is not None else loss, loss, lse, row_weight, grad_words,
            grad_scale, numpy.int64(scale_stride), row_stats.view(-1) if with_stats else loss,
            numpy.int64(ignore_index), eps, numpy.float32(softcap),
            numpy.float32(1.0 / softcap if softcap else 0.0), numpy.float32(lse_square_scale)))


def probabilities_forward(logits, target, weight, loss, lse, grad_logits, grad_scale, options) -> None:
    """Class-probability targets: loss and lse of every row; with grad_logits its gradient row too,
    grad_scale[i] * dloss_i / dlogits. With q = (1 - eps) * target + eps / C and A = sum_c w_c q_c:
    loss = sum_c w_c q_c ((m - u_c) + log S) + s * lse**2, gradient du/dx * (p * (A + 2 s lse) - w q)."""
    label_smoothing = options.label_smoothing
    softcap, lse_square_scale = options.softcap, options.lse_square_scale
    rows, classes = logits.shape
    with_grad = grad_logits is not None
    fmt, width, views = vector_views((logits, target, grad_logits) if with_grad else (logits, target))
    cache = max(_tuning.CE_PROBABILITIES_CACHE, width)
    cached = with_grad and classes <= min(_tuning.CE_CACHED_THREADS, MAX_THREADS) * cache
    if cached:
        per_thread, threads = cache, threads_for(classes, cache)
    else:
        per_thread, threads = max(_tuning.CE_UNROLL, width), threads_for(classes, 4 * _tuning.CE_UNROLL)
    softcap = _softcap_for_kernel(softcap)
    if with_grad:
        grad_words = views[2]
        grad_scale, scale_stride = _per_row(grad_scale)
    else:   # never read: placeholders of the right kinds
        grad_words, grad_scale, scale_stride = views[0], loss, 0
    kernel_ = probabilities_kernel(fmt, width, per_thread, cached, weight is not None, softcap != 0.0, with_grad)
    launch(kernel_, rows, threads,
           (views[0], views[1], weight if weight is not None else loss, loss, lse, grad_words, grad_scale,
            numpy.int64(scale_stride), numpy.float32(1.0 - label_smoothing),
            numpy.float32(label_smoothing / classes), numpy.float32(softcap),
            numpy.float32(1.0 / softcap if softcap else 0.0), numpy.float32(lse_square_scale)))


def gradient(logits, target, weight, row_max_sum, coefficients, grad_logits, options) -> None:
    """grad_logits[i, c] = du/dx * (a_i * exp(u_c - m_i) / S_i - b_i * [c == t_i] - c_i * w_c), (m, S) =
    row_max_sum[:, i] of the whole row, (a, b, c) = coefficients[:, i]; a target outside [0, C) has no term here.
    grad_logits may be logits itself."""
    softcap = options.softcap
    rows, classes = logits.shape
    if rows == 0 or classes == 0:
        return
    fmt, width, (logit_words, grad_words) = vector_views((logits, grad_logits))
    per_thread = max(_tuning.CE_GRADIENT_UNROLL, width)
    threads = min(_tuning.CE_GRADIENT_THREADS, threads_for(classes, per_thread))
    chunks = -(-(classes // width) // (threads * (per_thread // width)))
    softcap = _softcap_for_kernel(softcap)
    inv_softcap = 1.0 / softcap if softcap else 0.0
    kernel_ = _gradient(fmt, width, per_thread, weight is not None, softcap != 0.0)
    launch(kernel_, (chunks, min(rows, 65535)), threads,
           (logit_words, target, weight if weight is not None else row_max_sum, row_max_sum.view(-1),
            coefficients.view(-1), grad_words, numpy.float32(softcap), numpy.float32(inv_softcap)))


def scale(grad_logits, factor) -> None:
    """grad_logits *= factor: one factor for every row (shape (1,), read on the device: when it is 1 each block
    returns at once, touching nothing) or one a row (shape (M,))."""
    rows, classes = grad_logits.shape
    fmt, width, (grad_words,) = vector_views((grad_logits,))
    per_thread = max(_tuning.CE_SCALE_UNROLL, width)
    threads = min(_tuning.CE_SCALE_THREADS, threads_for(classes, per_thread))
    chunks = -(-(classes // width) // (threads * (per_thread // width)))
    sms = 1 if SIMULATOR else multiprocessors(device_index(grad_logits.device))
    row_blocks = min(rows, 65535, max(1, _tuning.CE_SCALE_BLOCKS_PER_SM * sms // chunks))
    factor, factor_stride = _per_row(factor)
    launch(_scale(fmt, width, per_thread), (chunks, row_blocks), threads,
           (grad_words, factor, numpy.int64(factor_stride)))
