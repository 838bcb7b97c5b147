// Row softmax / log_softmax, forward and backward.
// A row is split into tiles; block `rank` of a cluster (0 without clusters)
// owns tiles rank, rank + CLUSTER, ... A row that fits in one tile per block
// is read once and kept in registers; longer rows are re-read (newest tiles
// first, so they tend to come from L2) for the second pass.
#include "common.cuh"

template <typename T, int TPR, int ROWS, int VPT, int CLUSTER>
__device__ __forceinline__ void softmax_fwd_rows(const T* x, T* out, i64 M, i64 N, int log_mode, int vec_ok) {
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const i64 rank = CLUSTER > 1 ? (i64)cluster_rank() : 0;
    const i64 ntiles = (N + TL::SIZE - 1) / TL::SIZE;
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    const bool vec = vec_ok != 0;
    const DenseMap map;
    typename TL::Regs v;
    // The newest tile as floats: x for log_softmax, exp(x - own max) for softmax,
    // so that a row held in registers takes one exponential per element.
    float f[TL::EPT];
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        const T* xr = x + row * N;
        T* yr = out + row * N;
        Stats st = stats_empty();
        i64 last = -1;
        for (i64 t = rank; t < ntiles; t += CLUSTER) {
            TL::load(v, xr, map, t * TL::SIZE, N, lane, vec, -MS_INF);
            float tile_max = -MS_INF;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                f[e] = TL::get(v, e);
                tile_max = fmaxf(tile_max, f[e]);
            }
            st = stats_shift(st, tile_max);
            float acc = 0.f;
            if (st.m == -MS_INF) {  // nothing but -inf so far
                if (!log_mode) {
#pragma unroll
                    for (int e = 0; e < TL::EPT; ++e) f[e] = 0.f;
                }
            } else if (log_mode) {
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) acc += exp_diff(f[e], st.m);
            } else {
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) {
                    f[e] = exp_diff(f[e], st.m);
                    acc += f[e];
                }
            }
            st.s += acc;
            last = t;
        }
        const float own_max = st.m;
        st = row_reduce<TPR, CLUSTER>(st);
        const float inv_sum = 1.f / st.s, log_sum = logf(st.s);
        const float own_scale = exp_diff(own_max, st.m) * inv_sum;  // turns f into probabilities
        if (last >= 0) {  // the newest tile, still in registers
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) f[e] = log_mode ? (f[e] - st.m) - log_sum : f[e] * own_scale;
            TL::set_all(v, f);
            TL::store(v, yr, map, last * TL::SIZE, N, lane, vec);
        }
        for (i64 t = last - CLUSTER; t >= 0; t -= CLUSTER) {
            TL::load(v, xr, map, t * TL::SIZE, N, lane, vec, -MS_INF);
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float in = TL::get(v, e);
                f[e] = log_mode ? (in - st.m) - log_sum : exp_diff(in, st.m) * inv_sum;
            }
            TL::set_all(v, f);
            TL::store(v, yr, map, t * TL::SIZE, N, lane, vec);
        }
    }
}

// softmax: dx = y * (dy - sum(y * dy)); log_softmax: dx = dy - exp(y) * sum(dy).
template <typename T, int TPR, int ROWS, int VPT, int CLUSTER>
__device__ __forceinline__ void softmax_bwd_rows(const T* y, const T* dy, T* dx, i64 M, i64 N, int log_mode,
                                                 int vec_ok) {
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const i64 rank = CLUSTER > 1 ? (i64)cluster_rank() : 0;
    const i64 ntiles = (N + TL::SIZE - 1) / TL::SIZE;
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    const bool vec = vec_ok != 0;
    const DenseMap map;
    typename TL::Regs vy, vd;
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        const i64 base = row * N;
        Stats st = stats_empty();
        i64 last = -1;
        for (i64 t = rank; t < ntiles; t += CLUSTER) {
            TL::load(vy, y + base, map, t * TL::SIZE, N, lane, vec, 0.f);
            TL::load(vd, dy + base, map, t * TL::SIZE, N, lane, vec, 0.f);
            float acc = 0.f;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) acc += log_mode ? TL::get(vd, e) : TL::get(vy, e) * TL::get(vd, e);
            st.a += acc;
            last = t;
        }
        const float dot = row_reduce<TPR, CLUSTER>(st).a;
        for (i64 t = last; t >= 0; t -= CLUSTER) {
            if (t != last) {
                TL::load(vy, y + base, map, t * TL::SIZE, N, lane, vec, 0.f);
                TL::load(vd, dy + base, map, t * TL::SIZE, N, lane, vec, 0.f);
            }
            float out[TL::EPT];
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float fy = TL::get(vy, e), fd = TL::get(vd, e);
                out[e] = log_mode ? fd - exp_diff(fy, 0.f) * dot : fy * (fd - dot);
            }
            TL::set_all(vd, out);
            TL::store(vd, dx + base, map, t * TL::SIZE, N, lane, vec);
        }
    }
}

// MIN_BLOCKS: see MS_ROW_KERNEL_MIN.
template <typename T, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) softmax_fwd(const T* x, T* out, i64 M, i64 N, int log_mode, int vec_ok) {
    softmax_fwd_rows<T, TPR, ROWS, VPT, 1>(x, out, M, N, log_mode, vec_ok);
}

template <typename T, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) softmax_bwd(const T* y, const T* dy, T* dx, i64 M, i64 N, int log_mode,
                                                       int vec_ok) {
    softmax_bwd_rows<T, TPR, ROWS, VPT, 1>(y, dy, dx, M, N, log_mode, vec_ok);
}

#if __CUDA_ARCH__ >= 900
template <typename T, int TPR, int VPT, int CLUSTER, int MIN_BLOCKS = 0>
MS_CLUSTER_KERNEL(TPR, CLUSTER, MIN_BLOCKS) softmax_fwd_cluster(const T* x, T* out, i64 M, i64 N, int log_mode,
                                                                int vec_ok) {
    softmax_fwd_rows<T, TPR, 1, VPT, CLUSTER>(x, out, M, N, log_mode, vec_ok);
}

template <typename T, int TPR, int VPT, int CLUSTER, int MIN_BLOCKS = 0>
MS_CLUSTER_KERNEL(TPR, CLUSTER, MIN_BLOCKS) softmax_bwd_cluster(const T* y, const T* dy, T* dx, i64 M, i64 N,
                                                                int log_mode, int vec_ok) {
    softmax_bwd_rows<T, TPR, 1, VPT, CLUSTER>(y, dy, dx, M, N, log_mode, vec_ok);
}
#endif
