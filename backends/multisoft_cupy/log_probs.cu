// Per-token log-probabilities and entropy (backends/README.md, log_probs.py): the forward reads each row once for
// its statistics m = max u, S = sum exp(u - m) and E = sum exp(u - m) (u - m) / S; the backward reads it once more
// and writes its gradient once, elementwise, from those statistics and the incoming gradients.
// u = c / temperature with c = softcap * tanh(x / softcap) (CAP) or x; both kernels take u as c * inv_temperature
// and c from lp_capped, so that the backward's u of the row's largest logit is the forward's m bit for bit.
//
// Batch invariance: a row's arithmetic depends only on C, the element type and the instance (which _tuning picks
// from C and the element size). The forward always gives a thread the same columns, runs of VEC consecutive ones
// (Tile's vector layout), whether it loads them as 16-byte vectors (aligned tensors) or one by one, so that the
// reduction order does not depend on alignment either; the backward has no reduction.
#include "common.cuh"

#define LP_LOG2E 1.4426950408889634f
#define LP_LN2 0.6931471805599453f
#define LP_FLOAT_MAX 3.4028234663852886e38f

// c of a logit x under a softcap; __fmul_rn keeps every use of c (never contracted into an FMA) the same value.
__device__ __forceinline__ float lp_capped(float x, float softcap, float inv_cap) {
    return __fmul_rn(softcap, tanhf(x * inv_cap));
}

// Replaces every element e of a thread's tile by value(e), one register word at a time: the word's elements are
// read (by `value`) before the word is written (cross_entropy.cu's set_each).
template <typename T, int TPR, int VPT, class Value>
__device__ __forceinline__ void lp_set_each(typename Tile<T, TPR, VPT>::Regs& r, const Value& value) {
#pragma unroll
    for (int i = 0; i < VPT * 4; ++i) {
        if constexpr (Elem<T>::PER_WORD == 1) r.w[i] = __float_as_uint(value(i));
        else r.w[i] = pack_pair<T>(value(2 * i), value(2 * i + 1));
    }
}

// ---------------------------------------------------------------------------
// Forward statistics of a part of a row, in base-2 units: m the part's max of c (NaN if any value is NaN), and
// with d = (c - m) * k, k = log2(e) / temperature (so that 2^d = exp(u - max u)): s = sum 2^d, a = sum 2^d * d,
// where an element of c = -inf adds 0 to a. A part whose max is -inf holds s = a = 0.
// Moving a part to a larger max M (D = (m - M) * k <= 0): s' = 2^D s, a' = 2^D (a + D s).
// ---------------------------------------------------------------------------
struct LpStats {
    float m, s, a;
};

__device__ __forceinline__ LpStats lp_empty() { return LpStats{-MS_INF, 0.f, 0.f}; }

// The part `p` moved to the max `to` (>= p.m, or NaN); a part of max -inf adds nothing (never 0 * -inf).
__device__ __forceinline__ LpStats lp_moved(LpStats p, float to, float k) {
    if (p.m == -MS_INF) return LpStats{to, 0.f, 0.f};
    if (p.m == to) return p;
    const float d = (p.m - to) * k;
    const float f = exp2_approx(d);
    return LpStats{to, __fmul_rn(f, p.s), __fmul_rn(f, fmaf(d, p.s, p.a))};
}

// Symmetric in p and q (each moved to the common max on its own, then added), so that both lanes of a
// butterfly exchange get the same bits.
__device__ __forceinline__ LpStats lp_combine(LpStats p, LpStats q, float k) {
    const float m = max_nan(p.m, q.m);
    if (m == -MS_INF) return lp_empty();
    const LpStats a = lp_moved(p, m, k), b = lp_moved(q, m, k);
    return LpStats{m, a.s + b.s, a.a + b.a};
}

template <int WIDTH>
__device__ __forceinline__ LpStats lp_warp_reduce(LpStats v, float k) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o /= 2) {
        LpStats w;
        w.m = __shfl_xor_sync(MS_FULL_MASK, v.m, o);
        w.s = __shfl_xor_sync(MS_FULL_MASK, v.s, o);
        w.a = __shfl_xor_sync(MS_FULL_MASK, v.a, o);
        v = lp_combine(v, w, k);
    }
    return v;
}

// The row group's statistics, valid in its first thread (a warp: TPR == 32; the whole block: TPR > 32, which every
// thread of the block calls). The order is fixed by TPR: a butterfly in each warp, then one over the warps.
template <int TPR>
__device__ __forceinline__ LpStats lp_row_reduce(LpStats v, float k) {
    v = lp_warp_reduce<32>(v, k);
    if constexpr (TPR > 32) {
        constexpr int WARPS = TPR / 32;
        static_assert(WARPS <= 32 && (WARPS & (WARPS - 1)) == 0, "a power of two of warps, at most 32");
        __shared__ LpStats partial[WARPS];
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        __syncthreads();  // warp 0 has read the previous row's partials
        if (lane == 0) partial[warp] = v;
        __syncthreads();
        if (warp == 0) v = lp_warp_reduce<WARPS>(lane < WARPS ? partial[lane] : lp_empty(), k);
    }
    return v;
}

// Loads the tile at `start` into Tile's vector layout (thread `lane` holds runs of VEC consecutive columns):
// 16-byte vectors with `vec`, else the same columns one element at a time (any alignment, any C). Columns >= n
// take `fill`.
template <typename T, int TPR, int VPT>
__device__ __forceinline__ void lp_load_runs(typename Tile<T, TPR, VPT>::Regs& r, const T* base, i64 start, i64 n,
                                             int lane, bool vec, float fill) {
    using TL = Tile<T, TPR, VPT>;
    if (vec) {
        TL::load(r, base, DenseMap{}, start, n, lane, true, fill);
        return;
    }
    const u32 fill_bits = Elem<T>::bits(fill);
#pragma unroll
    for (int e = 0; e < TL::EPT; ++e) {
        const i64 c = TL::col(start, lane, e, true);
        u32 b = fill_bits;
        if (c < n) {
            if constexpr (TL::PER_WORD == 1) b = reinterpret_cast<const u32*>(base)[c];
            else b = reinterpret_cast<const u16*>(base)[c];
        }
        TL::put_bits(r, e, b);
    }
}

// row_stats (3, M): m, S, E of each row. A row group (a warp, or a block with TPR > 32) per row sweeps its tiles
// once, each thread keeping LpStats of its columns (moved to each tile's max, then the tile's terms added), and
// reduces them (lp_row_reduce); its first thread writes the row's three values. softcap, inv_cap: CAP only.
// vec_ok: logits start 16-byte aligned and C is a multiple of the 16-byte vector.
template <typename T, bool CAP, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) lp_fwd(const T* logits, float* row_stats, i64 M, i64 C, float softcap,
                                                 float inv_temperature, int vec_ok) {
    static_assert(TPR % 32 == 0, "a row group is made of whole warps (full-mask shuffles)");
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const i64 row_step = (i64)gridDim.x * ROWS;
    const bool vec = vec_ok != 0;
    const float inv_cap = CAP ? 1.f / softcap : 0.f;
    const float k = LP_LOG2E * inv_temperature;
    typename TL::Regs v;
    for (i64 row = (i64)blockIdx.x * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        const T* xr = logits + row * C;
        LpStats st = lp_empty();
        for (i64 tile = 0; tile < ntiles; ++tile) {
            const i64 start = tile * TL::SIZE;
            lp_load_runs<T, TPR, VPT>(v, xr, start, C, lane, vec, -MS_INF);
            const float tile_max = TL::max_value(v);  // c is an increasing function of x
            const float m = max_nan(st.m, CAP ? lp_capped(tile_max, softcap, inv_cap) : tile_max);
            st = lp_moved(st, m, k);
            if (m == -MS_INF) continue;  // nothing but -inf so far (uncapped): every term is 0
            float acc_s = 0.f, acc_a = 0.f;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float x = TL::get(v, e);
                float c = x;  // a capped column past the row's end (fill -inf) must stay -inf
                if constexpr (CAP) c = TL::col(start, lane, e, true) < C ? lp_capped(x, softcap, inv_cap) : -MS_INF;
                const float d = (c - m) * k;
                const float p = exp2_approx(d);  // 0 for c = -inf
                acc_s += p;
                acc_a = fmaf(p, fmaxf(d, -LP_FLOAT_MAX), acc_a);  // 0 * -FLT_MAX, not 0 * -inf, for c = -inf
            }
            st.s += acc_s;
            st.a += acc_a;
        }
        st = lp_row_reduce<TPR>(st, k);
        if (lane == 0) {
            row_stats[row] = __fmul_rn(st.m, inv_temperature);
            row_stats[M + row] = st.s;
            row_stats[2 * M + row] = st.a / st.s * LP_LN2;
        }
    }
}

// grad[i, j] = du/dx * (sum_k g[i, k] [j == t[i, k]] - p_j (a_i + c_i ((u_j - m_i) - E_i))),
// p_j = exp(u_j - m_i) / S_i, the p term 0 where u_j = -inf; (m, S, E) = row_stats[:, i], (a, c) = coefficients[:, i],
// t = target[i, :K], g = grad_target[i, :K]. An id outside [0, C) is only compared, never an index. One elementwise
// sweep with no reduction: block (x, y) writes tiles x, x + gridDim.x, ... of rows y, y + gridDim.y, ..., each
// element written by the thread that read it (grad may be logits). A thread that holds none of the row's ids in a
// tile (nearly all) takes the gradient without the id terms; one that holds some adds, for each of its elements
// among them, the g of every id there in order k = 0, 1, ... (duplicates add up).
template <typename T, typename TI, bool CAP, int THREADS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(THREADS, MIN_BLOCKS) lp_bwd(const T* logits, const TI* target, const float* row_stats,
                                              const float* grad_target, const float* coefficients, T* grad, i64 M,
                                              i64 C, i64 K, float softcap, float inv_temperature, int vec_ok) {
    using TL = Tile<T, THREADS, VPT>;
    static_assert(TL::EPT <= 32, "a thread's elements are flagged in one 32-bit mask");
    const int lane = threadIdx.x;
    const i64 ntiles = (C + TL::SIZE - 1) / TL::SIZE;
    const bool vec = vec_ok != 0;
    const float inv_cap = CAP ? 1.f / softcap : 0.f;
    const DenseMap map;
    typename TL::Regs v;
    // The element index (TL::col's e) of this thread that holds column start + rel, 0 <= rel < SIZE, or -1.
    auto element_of = [&](int rel) {
        if (vec) {
            const int run = rel / TL::VEC;
            return run % THREADS == lane ? run / THREADS * TL::VEC + rel % TL::VEC : -1;
        }
        return rel % THREADS == lane ? rel / THREADS : -1;
    };
    for (i64 row = blockIdx.y; row < M; row += gridDim.y) {
        const TI* ids = target + row * K;
        const float* id_grads = grad_target + row * K;
        const float m = row_stats[row], inv_sum = 1.f / row_stats[M + row], spread = row_stats[2 * M + row];
        const float at_all = coefficients[row], at_entropy = coefficients[M + row];
        for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            const i64 start = tile * TL::SIZE;
            TL::load(v, logits + row * C, map, start, C, lane, vec, 0.f);
            // the id of position k as an element of this thread in this tile, or -1
            auto held = [&](i64 kk) {
                const i64 t = (i64)ids[kk];
                const i64 rel = t - start;
                return t >= 0 && t < C && rel >= 0 && rel < TL::SIZE ? element_of((int)rel) : -1;
            };
            u32 mask = 0;  // this thread's elements that some id names
#pragma unroll 4
            for (i64 kk = 0; kk < K; ++kk) {
                const int e = held(kk);
                if (e >= 0) mask |= 1u << e;
            }
            auto gradient = [&](int e, float picked) {
                const float x = TL::get(v, e);
                float u, du;
                if constexpr (CAP) {
                    const float th = tanhf(x * inv_cap);
                    u = __fmul_rn(__fmul_rn(softcap, th), inv_temperature);  // lp_capped(x) / T, as the forward's m
                    du = (1.f - th) * (1.f + th) * inv_temperature;
                } else {
                    u = __fmul_rn(x, inv_temperature);
                    du = inv_temperature;
                }
                const float shifted = u - m;
                const float p = exp_diff(u, m) * inv_sum;
                const float term = u == -MS_INF ? 0.f : p * (at_all + at_entropy * (shifted - spread));
                return du * (picked - term);
            };
            if (mask == 0) {
                lp_set_each<T, THREADS, VPT>(v, [&](int e) { return gradient(e, 0.f); });
            } else {
                lp_set_each<T, THREADS, VPT>(v, [&](int e) {
                    float picked = 0.f;
                    if (mask >> e & 1u) {
#pragma unroll 1
                        for (i64 kk = 0; kk < K; ++kk) {
                            if (held(kk) == e) picked += id_grads[kk];
                        }
                    }
                    return gradient(e, picked);
                });
            }
            TL::store(v, grad + row * C, map, start, C, lane, vec);
        }
    }
}
