// Cross-entropy with class-index targets in one pass over the logits: a sweep of each row for its max m and
// sum S of exp(u - m) (online, tile by tile), then, when the gradient is wanted (GRAD), a second sweep that
// writes grad_scale[i] * dloss_i / dx, so that the backward only scales it (ce_scale). The second sweep takes
// the row's last tile from registers and re-reads the others newest first (they may still be in L2).
// u = softcap * tanh(x / softcap) with a softcap, else x; p = exp(u - m) / S, from m and S themselves.
//
// In place (grad == logits): each element is written only by the thread that read it, after it re-read it,
// and the row's reduction (a warp, block or cluster barrier) separates every read of the first sweep (the
// target's logit included) from every write of the row.
// Targets outside [0, C) that are not ignore_index are never dereferenced: their loss is NaN, their gradient
// row NaN.
// With `row_stats` (not null) the forward also writes each row's m, S and sum_c w[c] * u[c]: the statistics of a
// slice of the classes, which the front combines across ranks (vocabulary-parallel cross-entropy); ce_gradient
// then writes that slice's gradient from the whole row's statistics, in one elementwise sweep.
// ce_probs_fwd takes class-probability targets (a row of probabilities per row of logits) the same way.
#include "common.cuh"

template <bool FIRST, typename A, typename B>
struct Choose {
    using type = A;
};
template <typename A, typename B>
struct Choose<false, A, B> {
    using type = B;
};

template <typename T, typename TI>
struct CeArgs {
    const T* logits;
    const TI* target;
    const float* weight;  // (C,), or null: every weight 1
    float* loss;
    float* lse;
    float* row_weight;
    T* grad;                  // (M, C), or null without GRAD; may be `logits`
    const float* grad_scale;  // (M,) with grad_scale_stride 1, or one value with stride 0
    i64 grad_scale_stride;
    float* row_stats;  // (3, M): m, S, sum_c w[c] * u[c] of each row; or null
    i64 M, C, ignore_index;
    float eps, softcap, lse_square_scale;
    bool vec;
};

// Replaces every element e of a thread's tile by value(e), one register word at a time: the word's elements are
// read (by `value`) before the word is written, and no second copy of the tile is held.
template <typename T, int TPR, int VPT, class Value>
__device__ __forceinline__ void set_each(typename Tile<T, TPR, VPT>::Regs& r, const Value& value) {
#pragma unroll
    for (int i = 0; i < VPT * 4; ++i) {
        if constexpr (Elem<T>::PER_WORD == 1) r.w[i] = __float_as_uint(value(i));
        else r.w[i] = pack_pair<T>(value(2 * i), value(2 * i + 1));
    }
}

// One row group (TPR threads, a cluster's blocks with CLUSTER > 1) per row; CAP: softcap > 0 (a separate
// instance, so that the kernels without it keep their registers). Capped values are floats, not T values, so
// they take ShiftedExp<float>.
template <typename T, typename TI, bool GRAD, bool CAP, int TPR, int ROWS, int VPT, int CLUSTER>
__device__ __forceinline__ void ce_rows(const CeArgs<T, TI>& a) {
    static_assert(TPR % 32 == 0, "a row group is made of whole warps (full-mask shuffles and __syncwarp)");
    using TL = Tile<T, TPR, VPT>;
    using Exp = ShiftedExp<typename Choose<CAP, float, T>::type>;
    const int lane = threadIdx.x % TPR;
    const i64 rank = CLUSTER > 1 ? (i64)cluster_rank() : 0;
    const i64 C = a.C;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const i64 last_tile = rank < ntiles ? rank + (ntiles - 1 - rank) / CLUSTER * CLUSTER : -1;  // this rank's
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    const bool vec = a.vec, smooth = a.eps != 0.f, zloss = a.lse_square_scale != 0.f;
    const float eps = a.eps, inv_cap = CAP ? 1.f / a.softcap : 0.f;
    const DenseMap map;
    typename TL::Regs v;
    // the capped logit of column c >= C (a tile's padding) is -inf, as the uncapped one is
    auto logit = [&](int e, i64 start) {
        const float x = TL::get(v, e);
        if constexpr (CAP) return TL::col(start, lane, e, vec) < C ? a.softcap * tanhf(x * inv_cap) : -MS_INF;
        else return x;
    };
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < a.M; row += row_step) {
        const T* xr = a.logits + row * C;
        const i64 t = (i64)a.target[row];  // fetched early: its latency hides behind the tiles
        const float scale = GRAD ? a.grad_scale[row * a.grad_scale_stride] : 0.f;
        const bool ignored = t == a.ignore_index, valid = !ignored && t >= 0 && t < C;
        float target_weight = 0.f, target_logit = 0.f;
        // m, s: max and sum of exp(u - m); a: sum_c w[c] * u[c]; b: sum_c w[c] (label smoothing only)
        Stats st = stats_empty();
        for (i64 tile = rank; tile < ntiles; tile += CLUSTER) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, xr, map, start, C, lane, vec, -MS_INF);
            if (tile == rank && valid) {  // the target's weight and logit, once the first tile's loads are issued
                if (GRAD || (lane == 0 && rank == 0)) target_weight = a.weight ? a.weight[t] : 1.f;
                if (lane == 0 && rank == 0) target_logit = to_float(xr[t]);
            }
            const float tile_max = TL::max_value(v);  // u is an increasing function of x
            st = stats_shift(st, CAP ? a.softcap * tanhf(tile_max * inv_cap) : tile_max);
            if (st.m != -MS_INF) {
                const Exp ex(st.m);
                float acc = 0.f;
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) acc += ex(logit(e, start));
                st.s += ex.unshift(acc);
            }
            if (smooth) {
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) {
                    const i64 c = TL::col(start, lane, e, vec);
                    if (c < C) {
                        const float w = a.weight ? a.weight[c] : 1.f;
                        st.a += w * logit(e, start);
                        st.b += w;
                    }
                }
            }
        }
        st = row_reduce<TPR, CLUSTER>(st);
        const float row_lse = st.m + logf(st.s);
        if (lane == 0 && rank == 0) {
            // torch's logsumexp: +inf where a logit is (st.s is NaN then, from exp(inf - inf)); the loss keeps
            // row_lse, NaN as torch's is
            a.lse[row] = st.m == MS_INF ? st.m : row_lse;
            float value = ignored ? 0.f : MS_NAN;
            if (valid) {
                const float target_u = CAP ? a.softcap * tanhf(target_logit * inv_cap) : target_logit;
                value = (1.f - eps) * target_weight * (row_lse - target_u);
                if (smooth) value += eps / (float)C * (st.b * row_lse - st.a);
                if (zloss) value += a.lse_square_scale * row_lse * row_lse;
            }
            a.loss[row] = value;
            a.row_weight[row] = valid ? target_weight : 0.f;
            if (a.row_stats) {  // st.a is 0 without label smoothing
                a.row_stats[row] = st.m;
                a.row_stats[a.M + row] = st.s;
                a.row_stats[2 * a.M + row] = st.a;
            }
        }
        if constexpr (GRAD) {
            if constexpr (TPR == 32) __syncwarp();  // orders the warp's reads of the row before its writes
            T* gr = a.grad + row * C;
            // gradient = coef_p * ex(u) - coef_t * (c == t) - coef_w * w[c], times du/dx with a softcap
            const Exp ex(st.m);
            float coef_p = 0.f, coef_t = 0.f, coef_w = 0.f;
            if (valid) {
                float total = (1.f - eps) * target_weight;
                if (smooth) total += eps / (float)C * st.b;
                if (zloss) total += 2.f * a.lse_square_scale * row_lse;
                coef_p = scale * total * ex.unshift(1.f) / st.s;
                coef_t = scale * (1.f - eps) * target_weight;
                coef_w = scale * eps / (float)C;
            }
            const i64 lane_offset = vec ? (i64)lane * TL::VEC : (i64)lane;
            for (i64 tile = last_tile; tile >= rank; tile -= CLUSTER) {
                const i64 start = tile * TL::SIZE;
                if (valid) {
                    if (tile != last_tile) TL::load(v, xr, map, start, C, lane, vec, 0.f);
                    // the target's position among this thread's elements, as TL::offset counts them; -1 if absent
                    const i64 rel = t - start - lane_offset;
                    const int target_at = rel >= 0 && rel < TL::SIZE ? (int)rel : -1;
                    auto gradient = [&](int e) {
                        const float x = TL::get(v, e);
                        float u = x, du = 1.f;
                        if constexpr (CAP) {
                            const float th = tanhf(x * inv_cap);
                            u = a.softcap * th;
                            du = (1.f - th) * (1.f + th);
                        }
                        float g = coef_p * ex(u) - (TL::offset(e, vec) == target_at ? coef_t : 0.f);
                        if (smooth) {
                            const i64 c = TL::col(start, lane, e, vec);
                            g -= coef_w * (a.weight ? (c < C ? a.weight[c] : 0.f) : 1.f);
                        }
                        return CAP ? g * du : g;
                    };
                    set_each<T, TPR, VPT>(v, gradient);
                } else {
                    set_each<T, TPR, VPT>(v, [&](int) { return ignored ? 0.f : MS_NAN; });
                }
                TL::store(v, gr, map, start, C, lane, vec);
            }
        }
    }
}

// loss, lse, row_weight (M,) and with GRAD grad (M, C) = grad_scale[i * grad_scale_stride] * dloss_i / dx; with
// row_stats (not null) each row's m, S and sum_c w[c] * u[c] (lane 0 of each row, once: no cost in the sweeps).
// CAP: softcap > 0 (without it, softcap is unused). vec_ok: logits and grad start 16-byte aligned and C is a
// multiple of the 16-byte vector.
template <typename T, typename TI, bool GRAD, bool CAP, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) ce_fwd(const T* logits, const TI* target, const float* weight, float* loss,
                                                 float* lse, float* row_weight, T* grad, const float* grad_scale,
                                                 i64 grad_scale_stride, float* row_stats, i64 M, i64 C,
                                                 i64 ignore_index, float eps, float softcap, float lse_square_scale,
                                                 int vec_ok) {
    const CeArgs<T, TI> a{logits, target, weight, loss, lse, row_weight, grad, grad_scale, grad_scale_stride,
                          row_stats, M, C, ignore_index, eps, softcap, lse_square_scale, vec_ok != 0};
    ce_rows<T, TI, GRAD, CAP, TPR, ROWS, VPT, 1>(a);
}

#if __CUDA_ARCH__ >= 900
template <typename T, typename TI, bool GRAD, bool CAP, int TPR, int VPT, int CLUSTER, int MIN_BLOCKS = 0>
MS_CLUSTER_KERNEL(TPR, CLUSTER, MIN_BLOCKS) ce_fwd_cluster(const T* logits, const TI* target, const float* weight,
                                                           float* loss, float* lse, float* row_weight, T* grad,
                                                           const float* grad_scale, i64 grad_scale_stride,
                                                           float* row_stats, i64 M, i64 C, i64 ignore_index,
                                                           float eps, float softcap, float lse_square_scale,
                                                           int vec_ok) {
    const CeArgs<T, TI> a{logits, target, weight, loss, lse, row_weight, grad, grad_scale, grad_scale_stride,
                          row_stats, M, C, ignore_index, eps, softcap, lse_square_scale, vec_ok != 0};
    ce_rows<T, TI, GRAD, CAP, TPR, 1, VPT, CLUSTER>(a);
}
#endif

// Cross-entropy with class-probability targets: target (M, C) in the logits' type, q = (1 - eps) * target + eps / C,
// w = weight or 1, A = sum_c w[c] * q[c]. loss_i = sum_c w[c] * q[c] * ((m - u[c]) + log S) + s * lse^2 and, with
// GRAD, grad = grad_scale[i] * du/dx * (p * (A + 2 * s * lse) - w * q), p = exp(u - m) / S.
// The first sweep keeps, per thread, m and S, A and gap = sum w * q * (m - u) relative to the thread's running max
// (moved by A * (new max - old max) when the max grows, so that each term stays a difference of two nearby values,
// never lse rounded); a first row reduction gives the row's m, S and A, a second the row's gap, each thread's first
// moved to the row's max. A u of -inf contributes w * q * inf (NaN where w * q is 0, as torch's 0 * inf), whatever
// the max. The second sweep (GRAD) re-reads the targets and, but for the last tile kept in registers, the logits.
template <typename T>
struct CeProbsArgs {
    const T* logits;
    const T* target;      // (M, C): each row's class probabilities, any values
    const float* weight;  // (C,), or null: every weight 1
    float* loss;
    float* lse;
    T* grad;                  // (M, C), or null without GRAD; never `logits`
    const float* grad_scale;  // (M,) with grad_scale_stride 1, or one value with stride 0
    i64 grad_scale_stride;
    i64 M, C;
    float eps, softcap, lse_square_scale;
    bool vec;
};

template <typename T, bool GRAD, bool CAP, int TPR, int ROWS, int VPT, int CLUSTER>
__device__ __forceinline__ void ce_probs_rows(const CeProbsArgs<T>& a) {
    static_assert(TPR % 32 == 0, "a row group is made of whole warps (full-mask shuffles)");
    using TL = Tile<T, TPR, VPT>;
    using Exp = ShiftedExp<typename Choose<CAP, float, T>::type>;
    const int lane = threadIdx.x % TPR;
    const i64 rank = CLUSTER > 1 ? (i64)cluster_rank() : 0;
    const i64 C = a.C;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const i64 last_tile = rank < ntiles ? rank + (ntiles - 1 - rank) / CLUSTER * CLUSTER : -1;  // this rank's
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    const bool vec = a.vec, zloss = a.lse_square_scale != 0.f;
    const float target_share = 1.f - a.eps, uniform_share = a.eps / (float)C;  // q = target_share * t + uniform_share
    const float inv_cap = CAP ? 1.f / a.softcap : 0.f;
    const DenseMap map;
    typename TL::Regs v, probs;
    // the capped logit of column c >= C (a tile's padding) is -inf, as the uncapped one is
    auto logit = [&](int e, i64 start) {
        const float x = TL::get(v, e);
        if constexpr (CAP) return TL::col(start, lane, e, vec) < C ? a.softcap * tanhf(x * inv_cap) : -MS_INF;
        else return x;
    };
    // w[c] * q[c] of this thread's element e, column c < C
    auto weighted_q = [&](int e, i64 c) {
        const float w = a.weight ? a.weight[c] : 1.f;
        return w * fmaf(target_share, TL::get(probs, e), uniform_share);
    };
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < a.M; row += row_step) {
        const T* xr = a.logits + row * C;
        const T* tr = a.target + row * C;
        const float scale = GRAD ? a.grad_scale[row * a.grad_scale_stride] : 0.f;
        // m, s: max and sum of exp(u - m); a: A = sum_c w[c] * q[c]; b unused
        Stats st = stats_empty();
        float gap = 0.f;  // sum_c w[c] * q[c] * (st.m - u[c]) over this thread's columns so far
        for (i64 tile = rank; tile < ntiles; tile += CLUSTER) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, xr, map, start, C, lane, vec, -MS_INF);
            TL::load(probs, tr, map, start, C, lane, vec, 0.f);
            const float tile_max = TL::max_value(v);  // u is an increasing function of x
            const float previous_max = st.m;
            st = stats_shift(st, CAP ? a.softcap * tanhf(tile_max * inv_cap) : tile_max);
            // with no finite max yet, gap holds only terms of u = -inf, which do not depend on the max
            if (previous_max != -MS_INF && st.m != previous_max) gap += st.a * (st.m - previous_max);
            const bool has_max = st.m != -MS_INF;
            const Exp ex(st.m);
            float acc = 0.f;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float u = logit(e, start);
                if (has_max) acc += ex(u);
                const i64 c = TL::col(start, lane, e, vec);
                if (c < C) {
                    const float wq = weighted_q(e, c);
                    st.a += wq;
                    gap += wq * (u == -MS_INF ? MS_INF : st.m - u);
                }
            }
            if (has_max) st.s += ex.unshift(acc);
        }
        const Stats total = row_reduce<TPR, CLUSTER>(st);
        Stats moved = stats_empty();  // plain sums: stats_combine adds the a of two empty-max Stats
        moved.a = st.m == -MS_INF ? gap : gap + st.a * (total.m - st.m);
        const float row_gap = row_reduce<TPR, CLUSTER>(moved).a;
        const float log_sum = logf(total.s);
        const float row_lse = total.m + log_sum;
        if (lane == 0 && rank == 0) {
            a.lse[row] = total.m == MS_INF ? total.m : row_lse;  // as in ce_rows
            float value = row_gap + total.a * log_sum;
            if (zloss) value += a.lse_square_scale * row_lse * row_lse;
            a.loss[row] = value;
        }
        if constexpr (GRAD) {
            T* gr = a.grad + row * C;
            // gradient = coef_p * ex(u) - scale * w[c] * q[c], times du/dx with a softcap
            const Exp ex(total.m);
            const float factor = zloss ? total.a + 2.f * a.lse_square_scale * row_lse : total.a;
            const float coef_p = scale * factor * ex.unshift(1.f) / total.s;
            for (i64 tile = last_tile; tile >= rank; tile -= CLUSTER) {
                const i64 start = tile * TL::SIZE;
                if (tile != last_tile) TL::load(v, xr, map, start, C, lane, vec, 0.f);
                TL::load(probs, tr, map, start, C, lane, vec, 0.f);
                set_each<T, TPR, VPT>(v, [&](int e) {
                    const float x = TL::get(v, e);
                    float u = x, du = 1.f;
                    if constexpr (CAP) {
                        const float th = tanhf(x * inv_cap);
                        u = a.softcap * th;
                        du = (1.f - th) * (1.f + th);
                    }
                    const i64 c = TL::col(start, lane, e, vec);
                    const float g = coef_p * ex(u) - scale * (c < C ? weighted_q(e, c) : 0.f);
                    return CAP ? g * du : g;
                });
                TL::store(v, gr, map, start, C, lane, vec);
            }
        }
    }
}

// loss, lse (M,) and with GRAD grad (M, C) = grad_scale[i * grad_scale_stride] * dloss_i / dx for class-probability
// targets (M, C). CAP: softcap > 0 (without it, softcap is unused). vec_ok: logits, target and grad start 16-byte
// aligned and C is a multiple of the 16-byte vector.
template <typename T, bool GRAD, bool CAP, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) ce_probs_fwd(const T* logits, const T* target, const float* weight,
                                                       float* loss, float* lse, T* grad, const float* grad_scale,
                                                       i64 grad_scale_stride, i64 M, i64 C, float eps, float softcap,
                                                       float lse_square_scale, int vec_ok) {
    const CeProbsArgs<T> a{logits, target, weight, loss, lse, grad, grad_scale, grad_scale_stride,
                           M, C, eps, softcap, lse_square_scale, vec_ok != 0};
    ce_probs_rows<T, GRAD, CAP, TPR, ROWS, VPT, 1>(a);
}

#if __CUDA_ARCH__ >= 900
template <typename T, bool GRAD, bool CAP, int TPR, int VPT, int CLUSTER, int MIN_BLOCKS = 0>
MS_CLUSTER_KERNEL(TPR, CLUSTER, MIN_BLOCKS) ce_probs_fwd_cluster(const T* logits, const T* target,
                                                                 const float* weight, float* loss, float* lse,
                                                                 T* grad, const float* grad_scale,
                                                                 i64 grad_scale_stride, i64 M, i64 C, float eps,
                                                                 float softcap, float lse_square_scale,
                                                                 int vec_ok) {
    const CeProbsArgs<T> a{logits, target, weight, loss, lse, grad, grad_scale, grad_scale_stride,
                           M, C, eps, softcap, lse_square_scale, vec_ok != 0};
    ce_probs_rows<T, GRAD, CAP, TPR, 1, VPT, CLUSTER>(a);
}
#endif

// grad[i, :] *= factor[i * factor_stride] (factor_stride 0: one factor for every row). A row whose factor is
// exactly 1 is left untouched; with one factor of 1 for every row, every block returns at once.
// Block (x, y) scales tiles x, x + gridDim.x, ... of the y-th, (y + gridDim.y)-th, ... rows from the last.
template <typename T, int THREADS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(THREADS, MIN_BLOCKS) ce_scale(T* grad, const float* factor, i64 factor_stride, i64 M, i64 C,
                                                int vec_ok) {
    if (factor_stride == 0 && factor[0] == 1.f) return;
    using TL = Tile<T, THREADS, VPT>;
    const int lane = threadIdx.x;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const bool vec = vec_ok != 0;
    const DenseMap map;
    typename TL::Regs v;
    for (i64 step = blockIdx.y; step < M; step += gridDim.y) {
        const i64 row = M - 1 - step;
        const float f = factor[row * factor_stride];
        if (f == 1.f) continue;
        for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, grad + row * C, map, start, C, lane, vec, 0.f);
            set_each<T, THREADS, VPT>(v, [&](int e) { return TL::get(v, e) * f; });
            TL::store(v, grad + row * C, map, start, C, lane, vec);
        }
    }
}

// grad[i, c] = du/dx * (a_i * exp(u_c - m_i) / S_i - b_i * (c == t_i) - c_i * w[c]) for a slice of the classes:
// (m_i, S_i) = row_max_sum[i], row_max_sum[M + i] are the whole row's, (a_i, b_i, c_i) = coefficients[i],
// coefficients[M + i], coefficients[2M + i]; w = weight, or 1 where null. A target outside [0, C) is only
// compared, never an index. One elementwise sweep with no reduction: block (x, y) writes tiles x, x + gridDim.x,
// ... of rows y, y + gridDim.y, ..., each element written by the thread that read it (in place allowed).
// exp(u - m) takes exp_diff, not ShiftedExp: m is not one of this slice's values.
template <typename T, typename TI, bool CAP, int THREADS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(THREADS, MIN_BLOCKS) ce_gradient(const T* logits, const TI* target, const float* weight,
                                                   const float* row_max_sum, const float* coefficients, T* grad,
                                                   i64 M, i64 C, float softcap, int vec_ok) {
    using TL = Tile<T, THREADS, VPT>;
    const int lane = threadIdx.x;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const bool vec = vec_ok != 0;
    const float inv_cap = CAP ? 1.f / softcap : 0.f;
    const i64 lane_offset = vec ? (i64)lane * TL::VEC : (i64)lane;
    const DenseMap map;
    typename TL::Regs v;
    for (i64 row = blockIdx.y; row < M; row += gridDim.y) {
        const i64 t = (i64)target[row];
        const float m = row_max_sum[row];
        const float coef_p = coefficients[row] / row_max_sum[M + row];
        const float coef_t = coefficients[M + row], coef_w = coefficients[2 * M + row];
        for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, logits + row * C, map, start, C, lane, vec, 0.f);
            // the target's position among this thread's elements, as TL::offset counts them; -1 if absent
            const i64 rel = t - start - lane_offset;
            const int target_at = rel >= 0 && rel < TL::SIZE ? (int)rel : -1;
            set_each<T, THREADS, VPT>(v, [&](int e) {
                const float x = TL::get(v, e);
                float u = x, du = 1.f;
                if constexpr (CAP) {
                    const float th = tanhf(x * inv_cap);
                    u = softcap * th;
                    du = (1.f - th) * (1.f + th);
                }
                float g = coef_p * exp_diff(u, m) - (TL::offset(e, vec) == target_at ? coef_t : 0.f);
                if (weight) {
                    const i64 c = TL::col(start, lane, e, vec);
                    g -= coef_w * (c < C ? weight[c] : 0.f);
                } else {
                    g -= coef_w;
                }
                return CAP ? g * du : g;
            });
            TL::store(v, grad + row * C, map, start, C, lane, vec);
        }
    }
}
