// Row softmax / log_softmax, forward and backward, with the row held in registers.
// A row is split into tiles; block `rank` of a cluster (0 without clusters)
// owns tiles rank, rank + CLUSTER, ... A row that fits in one tile per block
// is read once and kept in registers; longer rows are re-read (newest tiles
// first, so they tend to come from L2) for the second pass.
#include "common.cuh"

// Row groups of TPR < 32 threads share a warp, whose shuffles need all its lanes: the groups of a warp walk
// rows together, from the warp's first row, and a group past the last row takes an empty row (no element read
// or written). `n` is the group's column count (0 past the last row), `row` a row inside the tensor.
struct RowSlot {
    i64 row, n;
};

template <int TPR, int ROWS, int CLUSTER>
__device__ __forceinline__ i64 warp_first_row() {
    constexpr int GROUPS = TPR < 32 ? 32 / TPR : 1;  // row groups per warp
    return (i64)(blockIdx.x / CLUSTER) * ROWS + (threadIdx.x / TPR) / GROUPS * GROUPS;
}

template <int TPR>
__device__ __forceinline__ RowSlot row_slot(i64 first, i64 M, i64 N) {
    const i64 row = TPR < 32 ? first + (threadIdx.x % 32) / TPR : first;
    return row < M ? RowSlot{row, N} : RowSlot{first, 0};
}

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
    // The newest tile as floats: x for log_softmax, exp(x - own max) for softmax (times own_fix, see
    // ShiftedExp), so that a row held in registers takes one exponential per element.
    float f[TL::EPT];
    for (i64 first = warp_first_row<TPR, ROWS, CLUSTER>(); first < M; first += row_step) {
        const RowSlot slot = row_slot<TPR>(first, M, N);
        const T* xr = x + slot.row * N;
        T* yr = out + slot.row * N;
        Stats st = stats_empty();
        float own_fix = 1.f;
        i64 last = -1;
        for (i64 t = rank; t < ntiles; t += CLUSTER) {
            TL::load(v, xr, map, t * TL::SIZE, slot.n, lane, vec, -MS_INF);
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) f[e] = TL::get(v, e);
            st = stats_shift(st, TL::max_value(v));
            float acc = 0.f;
            if (st.m == -MS_INF) {  // nothing but -inf so far
                if (!log_mode) {
#pragma unroll
                    for (int e = 0; e < TL::EPT; ++e) f[e] = 0.f;
                }
            } else {
                const ShiftedExp<T> ex(st.m);
                if (log_mode) {
#pragma unroll
                    for (int e = 0; e < TL::EPT; ++e) acc += ex(f[e]);
                } else {
#pragma unroll
                    for (int e = 0; e < TL::EPT; ++e) {
                        f[e] = ex(f[e]);
                        acc += f[e];
                    }
                }
                own_fix = ex.unshift(1.f);
                acc *= own_fix;
            }
            st.s += acc;
            last = t;
        }
        const float own_max = st.m;
        st = row_reduce<TPR, CLUSTER>(st);
        const float inv_sum = 1.f / st.s, log_sum = logf(st.s);
        const float own_scale = exp_diff(own_max, st.m) * inv_sum * own_fix;  // turns f into probabilities
        if (last >= 0) {  // the newest tile, still in registers
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) f[e] = log_mode ? (f[e] - st.m) - log_sum : f[e] * own_scale;
            TL::set_all(v, f);
            TL::store(v, yr, map, last * TL::SIZE, slot.n, lane, vec);
        }
        if (last - CLUSTER < 0) continue;
        const ShiftedExp<T> ex(st.m);
        const float fixed_inv_sum = ex.unshift(inv_sum);
        for (i64 t = last - CLUSTER; t >= 0; t -= CLUSTER) {
            TL::load(v, xr, map, t * TL::SIZE, slot.n, lane, vec, -MS_INF);
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float in = TL::get(v, e);
                f[e] = log_mode ? (in - st.m) - log_sum : ex(in) * fixed_inv_sum;
            }
            TL::set_all(v, f);
            TL::store(v, yr, map, t * TL::SIZE, slot.n, lane, vec);
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
    for (i64 first = warp_first_row<TPR, ROWS, CLUSTER>(); first < M; first += row_step) {
        const RowSlot slot = row_slot<TPR>(first, M, N);
        const i64 base = slot.row * N;
        Stats st = stats_empty();
        i64 last = -1;
        for (i64 t = rank; t < ntiles; t += CLUSTER) {
            TL::load(vy, y + base, map, t * TL::SIZE, slot.n, lane, vec, 0.f);
            TL::load(vd, dy + base, map, t * TL::SIZE, slot.n, lane, vec, 0.f);
            float acc = 0.f;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) acc += log_mode ? TL::get(vd, e) : TL::get(vy, e) * TL::get(vd, e);
            st.a += acc;
            last = t;
        }
        const float dot = row_reduce<TPR, CLUSTER>(st).a;
        for (i64 t = last; t >= 0; t -= CLUSTER) {
            if (t != last) {
                TL::load(vy, y + base, map, t * TL::SIZE, slot.n, lane, vec, 0.f);
                TL::load(vd, dy + base, map, t * TL::SIZE, slot.n, lane, vec, 0.f);
            }
            float out[TL::EPT];
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) {
                const float fy = TL::get(vy, e), fd = TL::get(vd, e);
                out[e] = softmax_gradient(fy, fd, dot, log_mode);
            }
            TL::set_all(vd, out);
            TL::store(vd, dx + base, map, t * TL::SIZE, slot.n, lane, vec);
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
