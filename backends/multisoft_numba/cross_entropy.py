"""Cross-entropy with class-index targets: forward (one block per row, one read of the
logits) and backward (elementwise over (row, column chunk), one read and one write).

A target outside [0, C) that is not ignore_index is never used as an index: its
loss is NaN and its gradient row NaN.

Kernels are built per codec kind (_device.codec), elements per thread, and whether
there is label smoothing and a weight; rows are indexed with unsigned integers (no
negative-index wraparound code).
"""

import functools

import numpy
from numba import cuda, float32, uint64

from ._device import NAN, NEG_INF, block_online_merge, block_sum, codec, expf, kahan_add, logf, online_add_all
from ._glue import MAX_THREADS, kernel, launch, threads_for, word_views

UNROLL = 16          # forward: elements per thread per step
BACKWARD_UNROLL = 16  # backward: elements per thread
BACKWARD_THREADS = 256
BF16_PAIRS = True    # bfloat16 rows of even length read and written two elements per access


@functools.cache
def _forward(kind, unroll, smooth, has_weight):
    per, unpack, _ = codec(kind)
    words = unroll // per

    @kernel
    def forward(x, target, weight, loss, lse, ignore_index, eps):
        row = cuda.blockIdx.x
        urow = uint64(row)
        x_row = x[urow]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_words = x.shape[1]
        n = n_words * per
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(unroll, float32)
        m = NEG_INF
        s = float32(0.0)
        weighted_x = float32(0.0)   # sum_c w[c] * x[c], for label smoothing
        lost = float32(0.0)
        weight_total = float32(0.0)
        for base in range(tid, n_words, threads * words):
            for k in range(words):
                c = base + k * threads
                if c < n_words:
                    got = unpack(x_row[uint64(c)])
                    for j in range(per):
                        vals[k * per + j] = got[j]
                else:
                    for j in range(per):
                        vals[k * per + j] = NEG_INF
            m, s = online_add_all(m, s, vals)
            if smooth:
                for k in range(words):
                    c = base + k * threads
                    if c < n_words:
                        for j in range(per):
                            if has_weight:
                                w = weight[c * per + j]
                                weighted_x, lost = kahan_add(weighted_x, lost, w * vals[k * per + j])
                                weight_total += w
                            else:
                                weighted_x, lost = kahan_add(weighted_x, lost, vals[k * per + j])
        m, s = block_online_merge(buf_m, buf_s, m, s)
        if smooth:
            weighted_x = block_sum(buf_s, weighted_x - lost)
            if has_weight:
                weight_total = block_sum(buf_s, weight_total)
            else:
                weight_total = float32(n)
        if tid == 0:
            row_lse = m + logf(s)
            lse[row] = row_lse
            t = target[row]
            if t == ignore_index:
                loss[row] = float32(0.0)
            elif t < 0 or t >= n:
                loss[row] = NAN
            else:
                w_t = weight[t] if has_weight else float32(1.0)
                x_t = unpack(x_row[uint64(t // per)])[t % per]
                value = (float32(1.0) - eps) * w_t * (row_lse - x_t)
                if smooth:
                    value += eps / float32(n) * (weight_total * row_lse - weighted_x)
                loss[row] = value

    return forward


@functools.cache
def _backward(kind, unroll, smooth, has_weight):
    per, unpack, pack = codec(kind)
    words = unroll // per

    @kernel
    def backward(x, target, weight, weight_sum, lse, grad_loss, grad, ignore_index, eps):
        row = cuda.blockIdx.x
        urow = uint64(row)
        x_row = x[urow]
        grad_row = grad[urow]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_words = x.shape[1]
        n = n_words * per
        start = cuda.blockIdx.y * threads * words + tid
        t = target[row]
        vals = cuda.local.array(unroll, float32)
        if t == ignore_index or t < 0 or t >= n:
            fill = float32(0.0) if t == ignore_index else NAN
            for k in range(words):
                c = start + k * threads
                if c < n_words:
                    grad_row[uint64(c)] = pack(fill, fill)
            return
        g = grad_loss[row]
        row_lse = lse[row]
        w_t = weight[t] if has_weight else float32(1.0)
        w_total = weight_sum[0] if has_weight else float32(n)
        hit = g * (float32(1.0) - eps) * w_t        # coefficient of (p - [c == t])
        spread = g * eps / float32(n)               # coefficient of (W * p - w[c])
        coef_p = hit + spread * w_total
        for k in range(words):
            c = start + k * threads
            if c < n_words:
                got = unpack(x_row[uint64(c)])
                for j in range(per):
                    vals[k * per + j] = got[j]
        for k in range(words):
            c = start + k * threads
            if c < n_words:
                for j in range(per):
                    col = c * per + j
                    value = coef_p * expf(vals[k * per + j] - row_lse)
                    if col == t:
                        value -= hit
                    if smooth:
                        value -= spread * (weight[col] if has_weight else float32(1.0))
                    vals[k * per + j] = value
                grad_row[uint64(c)] = pack(vals[k * per], vals[k * per + per - 1])

    return backward


def forward(logits, target, weight, loss, lse, ignore_index: int, label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = threads_for(classes, 4 * UNROLL)
    kind, (logit_words,) = word_views((logits,), BF16_PAIRS)
    weight_or_placeholder = weight if weight is not None else loss   # never read when weight is None
    launch(_forward(kind, UNROLL, bool(numpy.float32(label_smoothing)), weight is not None), rows, threads,
           (logit_words, target, weight_or_placeholder, loss, lse, numpy.int64(ignore_index),
            numpy.float32(label_smoothing)))


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = min(BACKWARD_THREADS, threads_for(classes, BACKWARD_UNROLL))
    kind, (logit_words, grad_words) = word_views((logits, grad_logits), BF16_PAIRS)
    per = codec(kind)[0]
    words_per_chunk = threads * (BACKWARD_UNROLL // per)
    chunks = -(-logit_words.shape[1] // words_per_chunk)
    has_weight = weight is not None
    launch(_backward(kind, BACKWARD_UNROLL, bool(numpy.float32(label_smoothing)), has_weight), (rows, chunks), threads,
           (logit_words, target, weight if has_weight else lse, weight_sum if has_weight else lse, lse, grad_loss,
            grad_words, numpy.int64(ignore_index), numpy.float32(label_smoothing)))
