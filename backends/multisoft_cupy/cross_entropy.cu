// Cross-entropy with class-index targets: a forward that streams each row
// once (online logsumexp) and an elementwise backward from the saved lse.
// Targets outside [0, C) that are not ignore_index are never dereferenced:
// their loss is NaN and their gradient row NaN.
#include "common.cuh"

template <typename T, typename TI, int TPR, int ROWS, int VPT, int CLUSTER>
__device__ __forceinline__ void ce_fwd_rows(const T* logits, const TI* target, const float* weight, float* loss,
                                            float* lse, float* row_weight, i64 M, i64 C, i64 ignore_index, float eps,
                                            int vec_ok) {
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const i64 rank = CLUSTER > 1 ? (i64)cluster_rank() : 0;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    const bool vec = vec_ok != 0, smooth = eps != 0.f;
    const DenseMap map;
    typename TL::Regs v;
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        const T* xr = logits + row * C;
        const i64 t = (i64)target[row];  // fetched early: its latency hides behind the tiles
        // m, s: logsumexp; a: sum_c w[c] * x[c]; b: sum_c w[c] (label smoothing only)
        Stats st = stats_empty();
        for (i64 tile = rank; tile < ntiles; tile += CLUSTER) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, xr, map, start, C, lane, vec, -MS_INF);
            st = stats_shift(st, TL::max_value(v));
            if (st.m != -MS_INF) {
                const ShiftedExp<T> ex(st.m);
                float acc = 0.f;
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) acc += ex(TL::get(v, e));
                st.s += ex.unshift(acc);
            }
            if (smooth) {
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) {
                    const i64 c = TL::col(start, lane, e, vec);
                    if (c < C) {
                        const float w = weight ? weight[c] : 1.f;
                        st.a += w * TL::get(v, e);
                        st.b += w;
                    }
                }
            }
        }
        st = row_reduce<TPR, CLUSTER>(st);
        if (lane == 0 && rank == 0) {
            const float row_lse = st.m + logf(st.s);
            lse[row] = row_lse;
            float value, wt = 0.f;
            if (t == ignore_index) {
                value = 0.f;
            } else if (t < 0 || t >= C) {
                value = MS_NAN;
            } else {
                wt = weight ? weight[t] : 1.f;
                value = (1.f - eps) * wt * (row_lse - to_float(xr[t]));
                if (smooth) value += eps / (float)C * (st.b * row_lse - st.a);
            }
            loss[row] = value;
            row_weight[row] = wt;
        }
    }
}

template <typename T, typename TI, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) ce_fwd(const T* logits, const TI* target, const float* weight, float* loss,
                                                 float* lse, float* row_weight, i64 M, i64 C, i64 ignore_index,
                                                 float eps, int vec_ok) {
    ce_fwd_rows<T, TI, TPR, ROWS, VPT, 1>(logits, target, weight, loss, lse, row_weight, M, C, ignore_index, eps,
                                          vec_ok);
}

#if __CUDA_ARCH__ >= 900
template <typename T, typename TI, int TPR, int VPT, int CLUSTER, int MIN_BLOCKS = 0>
MS_CLUSTER_KERNEL(TPR, CLUSTER, MIN_BLOCKS) ce_fwd_cluster(const T* logits, const TI* target, const float* weight,
                                                           float* loss, float* lse, float* row_weight, i64 M, i64 C,
                                                           i64 ignore_index, float eps, int vec_ok) {
    ce_fwd_rows<T, TI, TPR, 1, VPT, CLUSTER>(logits, target, weight, loss, lse, row_weight, M, C, ignore_index, eps,
                                             vec_ok);
}
#endif

// grad[i, c] = g * ((1 - eps) * w[t] * (p[c] - (c == t)) + eps / C * (W * p[c] - w[c])),
// g = grad_loss[i * grad_stride] (grad_stride 0: one gradient for every row).
// Block (x, y) handles tiles x, x + gridDim.x, ... of the y-th, (y + gridDim.y)-th, ... rows,
// counted from the last row (the forward ends there, so those tiles may still be in L2).
// `grad` may be `logits`: every element is read before the same thread writes it.
template <typename T, typename TI, int THREADS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(THREADS, MIN_BLOCKS) ce_bwd(const T* logits, const TI* target, const float* weight,
                                              const float* weight_sum, const float* lse, const float* grad_loss,
                                              i64 grad_stride, T* grad, i64 M, i64 C, i64 ignore_index, float eps,
                                              int vec_ok) {
    using TL = Tile<T, THREADS, VPT>;
    const int lane = threadIdx.x;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const bool vec = vec_ok != 0, smooth = eps != 0.f;
    const DenseMap map;
    typename TL::Regs v;
    for (i64 step = blockIdx.y; step < M; step += gridDim.y) {
        const i64 row = M - 1 - step;
        for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            const i64 start = tile * TL::SIZE;
            // loaded before the row's scalars are known, so that their latencies overlap
            TL::load(v, logits + row * C, map, start, C, lane, vec, 0.f);
            const i64 t = (i64)target[row];
            const bool ignored = t == ignore_index, invalid = !ignored && (t < 0 || t >= C);
            const float g = grad_loss[row * grad_stride], row_lse = lse[row];
            float out[TL::EPT];
            if (ignored || invalid) {
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) out[e] = invalid ? MS_NAN : 0.f;
            } else {
                const float target_coef = g * (1.f - eps) * (weight ? weight[t] : 1.f);
                const float smooth_coef = g * eps / (float)C;
                const float total_weight = weight ? *weight_sum : (float)C;
                // the target's position among this thread's elements, as TL::offset counts them; -1 if absent
                const i64 rel = t - start - (vec ? (i64)lane * TL::VEC : (i64)lane);
                const int target_at = rel >= 0 && rel < TL::SIZE ? (int)rel : -1;
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) {
                    const float p = exp_diff(TL::get(v, e), row_lse);
                    float value = target_coef * p - (TL::offset(e, vec) == target_at ? target_coef : 0.f);
                    if (smooth) {
                        const i64 c = TL::col(start, lane, e, vec);
                        value += smooth_coef * (total_weight * p - (weight ? (c < C ? weight[c] : 0.f) : 1.f));
                    }
                    out[e] = value;
                }
            }
            TL::set_all(v, out);
            TL::store(v, grad + row * C, map, start, C, lane, vec);
        }
    }
}
