"""Cross-entropy with class-index targets: forward (one block per row, one read of the
logits) and backward (elementwise over (row, column chunk), one read and one write).

A target outside [0, C) that is not ignore_index is never used as an index: its
loss is NaN and its gradient row NaN.
"""

import numpy
from numba import cuda, float32

from ._device import NAN, NEG_INF, block_online_merge, block_sum, expf, kahan_add, load, logf, online_add_all, store
from ._glue import MAX_THREADS, is_bf16, kernel, launch, threads_for

UNROLL = 16          # forward: loads per thread per step
BACKWARD_UNROLL = 8  # backward: elements per thread (more spills registers)
BACKWARD_THREADS = 256


@kernel
def _forward(x, target, weight, loss, lse, ignore_index, eps, has_weight, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    smooth = eps != float32(0.0)
    buf_m = cuda.shared.array(MAX_THREADS, float32)
    buf_s = cuda.shared.array(MAX_THREADS, float32)
    vals = cuda.local.array(UNROLL, float32)
    m = NEG_INF
    s = float32(0.0)
    weighted_x = float32(0.0)   # sum_c w[c] * x[c], for label smoothing
    lost = float32(0.0)
    weight_total = float32(0.0)
    for base in range(tid, n, threads * UNROLL):
        for k in range(UNROLL):
            c = base + k * threads
            v = NEG_INF
            if c < n:
                v = load(x, row, c, bf16)
            vals[k] = v
        m, s = online_add_all(m, s, vals)
        if smooth:
            for k in range(UNROLL):
                c = base + k * threads
                if c < n:
                    if has_weight:
                        weighted_x, lost = kahan_add(weighted_x, lost, weight[c] * vals[k])
                        weight_total += weight[c]
                    else:
                        weighted_x, lost = kahan_add(weighted_x, lost, vals[k])
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
            value = (float32(1.0) - eps) * w_t * (row_lse - load(x, row, t, bf16))
            if smooth:
                value += eps / float32(n) * (weight_total * row_lse - weighted_x)
            loss[row] = value


@kernel
def _backward(x, target, weight, weight_sum, lse, grad_loss, grad, ignore_index, eps, has_weight, bf16):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = x.shape[1]
    start = cuda.blockIdx.y * threads * BACKWARD_UNROLL + tid
    t = target[row]
    vals = cuda.local.array(BACKWARD_UNROLL, float32)
    if t == ignore_index or t < 0 or t >= n:
        fill = float32(0.0) if t == ignore_index else NAN
        for k in range(BACKWARD_UNROLL):
            c = start + k * threads
            if c < n:
                store(grad, row, c, fill, bf16)
        return
    g = grad_loss[row]
    row_lse = lse[row]
    w_t = weight[t] if has_weight else float32(1.0)
    w_total = weight_sum[0] if has_weight else float32(n)
    hit = g * (float32(1.0) - eps) * w_t        # coefficient of (p - [c == t])
    spread = g * eps / float32(n)               # coefficient of (W * p - w[c])
    coef_p = hit + spread * w_total
    for k in range(BACKWARD_UNROLL):
        c = start + k * threads
        if c < n:
            vals[k] = load(x, row, c, bf16)
    for k in range(BACKWARD_UNROLL):
        c = start + k * threads
        if c < n:
            value = coef_p * expf(vals[k] - row_lse)
            if c == t:
                value -= hit
            if eps != float32(0.0):
                value -= spread * (weight[c] if has_weight else float32(1.0))
            store(grad, row, c, value, bf16)


def forward(logits, target, weight, loss, lse, ignore_index: int, label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = threads_for(classes, 4 * UNROLL)
    weight_or_placeholder = weight if weight is not None else loss   # never read when weight is None
    launch(_forward, rows, threads,
           (logits, target, weight_or_placeholder, loss, lse, numpy.int64(ignore_index),
            numpy.float32(label_smoothing), weight is not None, is_bf16(logits)))


def backward(logits, target, weight, weight_sum, lse, grad_loss, grad_logits, ignore_index: int,
             label_smoothing: float) -> None:
    rows, classes = logits.shape
    threads = min(BACKWARD_THREADS, threads_for(classes, BACKWARD_UNROLL))
    chunks = -(-classes // (threads * BACKWARD_UNROLL))
    has_weight = weight is not None
    launch(_backward, (rows, chunks), threads,
           (logits, target, weight if has_weight else lse, weight_sum if has_weight else lse, lse, grad_loss,
            grad_logits, numpy.int64(ignore_index), numpy.float32(label_smoothing), has_weight, is_bf16(logits)))
