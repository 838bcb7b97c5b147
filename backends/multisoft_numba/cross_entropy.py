"""Cross-entropy with class-index targets: forward (one block per row, one read of the
logits) and backward (elementwise over (row, column chunk), one read and one write).

A target outside [0, C) that is not ignore_index is never used as an index: its
loss is NaN and its gradient row NaN.

Kernels are built per element format and vector width (_device.row_io), elements
per thread, and whether there is label smoothing and a weight; rows are read and
written a vector at a time through one-row views indexed with unsigned integers (no
negative-index wraparound code).
"""

import functools

import numpy
from numba import cuda, float32, uint64

from . import _tuning
from ._device import (NAN, NEG_INF, block_online_merge, block_sum, expf, kahan_add, logf, online_add_all,
                      row_io, strided_io, word_layout)
from ._launch import MAX_THREADS, kernel, launch, threads_for, vector_views


@functools.cache
def _forward(fmt, width, unroll, smooth, has_weight):
    vectors = unroll // width
    read_vectors, _ = strided_io(fmt, width, vectors)
    read, _ = row_io(fmt, width)
    words = word_layout(fmt, width)[1]

    @kernel
    def forward(x, target, weight, loss, lse, row_weight, ignore_index, eps):
        row = cuda.blockIdx.x
        x_row = x[uint64(row)]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        n = n_vectors * width
        buf_m = cuda.shared.array(MAX_THREADS, float32)
        buf_s = cuda.shared.array(MAX_THREADS, float32)
        vals = cuda.local.array(unroll, float32)
        m = NEG_INF
        s = float32(0.0)
        weighted_x = float32(0.0)   # sum_c w[c] * x[c], for label smoothing
        lost = float32(0.0)
        weight_total = float32(0.0)
        for base in range(tid, n_vectors, threads * vectors):
            read_vectors(x_row, base, threads, n_vectors, vals, NEG_INF)
            m, s = online_add_all(m, s, vals)
            if smooth:
                for k in range(vectors):
                    c = base + k * threads
                    if c < n_vectors:
                        for j in range(width):
                            if has_weight:
                                w = weight[c * width + j]
                                weighted_x, lost = kahan_add(weighted_x, lost, w * vals[k * width + j])
                                weight_total += w
                            else:
                                weighted_x, lost = kahan_add(weighted_x, lost, vals[k * width + j])
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
            row_weight[row] = float32(0.0)
            if t == ignore_index:
                loss[row] = float32(0.0)
            elif t < 0 or t >= n:
                loss[row] = NAN
            else:
                w_t = weight[t] if has_weight else float32(1.0)
                row_weight[row] = w_t
                read(x_row, t // width, vals, 0)
                x_t = vals[0]
                for j in range(1, width):
                    if t % width == j:
                        x_t = vals[j]
                value = (float32(1.0) - eps) * w_t * (row_lse - x_t)
                if smooth:
                    value += eps / float32(n) * (weight_total * row_lse - weighted_x)
                loss[row] = value

    return forward


@functools.cache
def _backward(fmt, width, unroll, smooth, has_weight):
    vectors = unroll // width
    read_vectors, write_vectors = strided_io(fmt, width, vectors)
    words = word_layout(fmt, width)[1]

    @kernel
    def backward(x, target, weight, weight_sum, lse, grad_loss, grad_stride, grad, ignore_index, eps):
        row = cuda.blockIdx.x
        x_row = x[uint64(row)]
        grad_row = grad[uint64(row)]
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        n_vectors = x.shape[1] // words
        n = n_vectors * width
        first = cuda.blockIdx.y * threads * vectors + tid
        t = target[row]
        vals = cuda.local.array(unroll, float32)
        if t == ignore_index or t < 0 or t >= n:
            fill = float32(0.0) if t == ignore_index else NAN
            for k in range(unroll):
                vals[k] = fill
            write_vectors(grad_row, first, threads, n_vectors, vals)
            return
        g = grad_loss[row * grad_stride]
        row_lse = lse[row]
        w_t = weight[t] if has_weight else float32(1.0)
        w_total = weight_sum[0] if has_weight else float32(n)
        hit = g * (float32(1.0) - eps) * w_t        # coefficient of (p - [c == t])
        spread = g * eps / float32(n)               # coefficient of (W * p - w[c])
        coef_p = hit + spread * w_total
        read_vectors(x_row, first, threads, n_vectors, vals, float32(0.0))
        for k in range(vectors):
            c = first + k * threads
            if c < n_vectors:
                for j in range(width):
                    col = c * width + j
                    value = coef_p * expf(vals[k * width + j] - row_lse)
                    if col == t:
                        value -= hit
                    if smooth:
                        value -= spread * (weight[col] if has_weight else float32(1.0))
                    vals[k * width + j] = value
        write_vectors(grad_row, first, threads, n_vectors, vals)

    return backward


def forward(logits, target, weight, loss, lse, row_weight, ignore_index: int, label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = threads_for(classes, 4 * _tuning.CE_UNROLL)
    fmt, width, (logit_words,) = vector_views((logits,))
    weight_or_placeholder = weight if weight is not None else loss   # never read when weight is None
    smooth = bool(numpy.float32(label_smoothing))
    launch(_forward(fmt, width, _tuning.CE_UNROLL, smooth, weight is not None), rows, threads,
           (logit_words, target, weight_or_placeholder, loss, lse, row_weight, numpy.int64(ignore_index),
            numpy.float32(label_smoothing)))


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = min(_tuning.CE_BACKWARD_THREADS, threads_for(classes, _tuning.CE_BACKWARD_UNROLL))
    fmt, width, (logit_words, grad_words) = vector_views((logits, grad_logits))
    chunks = -(-(classes // width) // (threads * (_tuning.CE_BACKWARD_UNROLL // width)))
    has_weight = weight is not None
    grad_stride = grad_loss.stride(0)
    if grad_stride == 0:   # one gradient for every row: its single element, as a contiguous array
        grad_loss = grad_loss[:1]
    launch(_backward(fmt, width, _tuning.CE_BACKWARD_UNROLL, bool(numpy.float32(label_smoothing)), has_weight),
           (rows, chunks), threads,
           (logit_words, target, weight if has_weight else lse, weight_sum if has_weight else lse, lse,
            grad_loss, numpy.int64(grad_stride), grad_words, numpy.int64(ignore_index),
            numpy.float32(label_smoothing)))
