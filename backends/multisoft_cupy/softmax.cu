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

// ---------------------------------------------------------------------------
// Rows staged in shared memory. Each block copies its slice of a row (with
// CLUSTER > 1, one of the cluster's consecutive slices) into shared memory with
// cp.async and works on it there, so the bytes a multiprocessor has in flight
// are bounded by its shared memory (up to 227 KB) rather than by registers,
// which hold 16-bit data as floats. The cluster combines its statistics
// through distributed shared memory. A thread reads back only the vectors it
// copied, so the copies need no barrier. A row group of TPR threads works on
// a row: a block (TPR > 32: ROWS = 1, and with CLUSTER > 1 the cluster) or a
// warp (TPR = 32: ROWS rows per block). Needs N % VEC == 0, 16-byte aligned
// rows and a `slice` that is a multiple of VEC; dynamic shared memory:
// ROWS x staged tensors x slice elements.
// ---------------------------------------------------------------------------
template <typename T>
struct Staged {
    using V = Tile<T, 1, 1>;  // one 16-byte vector
    static constexpr int VEC = V::VEC;
    __device__ static __forceinline__ typename V::Regs regs(const uint4& q) {
        typename V::Regs r;
        r.w[0] = q.x; r.w[1] = q.y; r.w[2] = q.z; r.w[3] = q.w;
        return r;
    }
    __device__ static __forceinline__ uint4 pack(const float (&f)[VEC]) {
        typename V::Regs r;
        V::set_all(r, f);
        return make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    }
    // Vectors of this block's slice of a row: begin = rank * slice.
    __device__ static __forceinline__ int vectors(i64 begin, i64 N, i64 slice) {
        return begin < N ? (int)(min(N - begin, slice) / VEC) : 0;
    }
};

// Copies this thread's vectors (lane, lane + TPR, ...) of the slice of `row` of each tensor into `buf`
// (tensor t at t * stride) and waits for them.
template <typename T, int TPR, int TENSORS>
__device__ __forceinline__ void stage_row(uint4* buf, int stride, const T* const (&src)[TENSORS], i64 row, i64 N,
                                          i64 begin, int vectors, int lane) {
    for (int i = lane; i < vectors; i += TPR) {
#pragma unroll
        for (int t = 0; t < TENSORS; ++t)
            cp_async16(buf + t * stride + i, reinterpret_cast<const uint4*>(src[t] + row * N + begin) + i);
    }
    cp_async_wait_all();
}

template <typename T, int TPR, int ROWS, int CLUSTER>
__device__ __forceinline__ void softmax_fwd_staged_rows(const T* x, T* out, i64 M, i64 N, i64 slice,
                                                        int log_mode) {
    using S = Staged<T>;
    extern __shared__ uint4 stage[];
    const int stride = (int)(slice / S::VEC);
    const int lane = threadIdx.x % TPR;
    uint4* xs = stage + (threadIdx.x / TPR) * stride;
    const i64 begin = (CLUSTER > 1 ? (i64)cluster_rank() : 0) * slice;
    const int vectors = S::vectors(begin, N, slice);
    const T* const src[1] = {x};
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        stage_row<T, TPR, 1>(xs, stride, src, row, N, begin, vectors, lane);
        float m = -MS_INF;
        for (int i = lane; i < vectors; i += TPR) {
            const auto r = S::regs(xs[i]);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) m = fmaxf(m, S::V::get(r, e));
        }
        Stats st = stats_empty();
        st.m = m;
        if (m != -MS_INF) {
            float s = 0.f;
            for (int i = lane; i < vectors; i += TPR) {
                const auto r = S::regs(xs[i]);
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) s += exp_diff(S::V::get(r, e), m);
            }
            st.s = s;
        }
        st = row_reduce<TPR, CLUSTER>(st);
        const float inv_sum = 1.f / st.s, log_sum = logf(st.s);
        uint4* dst = reinterpret_cast<uint4*>(out + row * N + begin);
        for (int i = lane; i < vectors; i += TPR) {
            const auto r = S::regs(xs[i]);
            float f[S::VEC];
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) {
                const float in = S::V::get(r, e);
                f[e] = log_mode ? (in - st.m) - log_sum : exp_diff(in, st.m) * inv_sum;
            }
            dst[i] = S::pack(f);
        }
    }
}

// Stages y and dy.
template <typename T, int TPR, int ROWS, int CLUSTER>
__device__ __forceinline__ void softmax_bwd_staged_rows(const T* y, const T* dy, T* dx, i64 M, i64 N, i64 slice,
                                                        int log_mode) {
    using S = Staged<T>;
    extern __shared__ uint4 stage[];
    const int stride = (int)(slice / S::VEC);
    const int lane = threadIdx.x % TPR;
    uint4* ys = stage + (threadIdx.x / TPR) * 2 * stride;
    const uint4* ds = ys + stride;
    const i64 begin = (CLUSTER > 1 ? (i64)cluster_rank() : 0) * slice;
    const int vectors = S::vectors(begin, N, slice);
    const T* const src[2] = {y, dy};
    const i64 row_step = (i64)(gridDim.x / CLUSTER) * ROWS;
    for (i64 row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / TPR; row < M; row += row_step) {
        stage_row<T, TPR, 2>(ys, stride, src, row, N, begin, vectors, lane);
        float acc = 0.f;
        for (int i = lane; i < vectors; i += TPR) {
            const auto ry = S::regs(ys[i]), rd = S::regs(ds[i]);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) acc += log_mode ? S::V::get(rd, e) : S::V::get(ry, e) * S::V::get(rd, e);
        }
        Stats st = stats_empty();
        st.a = acc;
        const float dot = row_reduce<TPR, CLUSTER>(st).a;
        uint4* dst = reinterpret_cast<uint4*>(dx + row * N + begin);
        for (int i = lane; i < vectors; i += TPR) {
            const auto ry = S::regs(ys[i]), rd = S::regs(ds[i]);
            float f[S::VEC];
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) {
                const float fy = S::V::get(ry, e), fd = S::V::get(rd, e);
                f[e] = log_mode ? fd - exp_diff(fy, 0.f) * dot : fy * (fd - dot);
            }
            dst[i] = S::pack(f);
        }
    }
}

template <typename T, int TPR, int ROWS>
MS_ROW_KERNEL_MIN(TPR * ROWS, 1) softmax_fwd_staged(const T* x, T* out, i64 M, i64 N, i64 slice, int log_mode) {
    softmax_fwd_staged_rows<T, TPR, ROWS, 1>(x, out, M, N, slice, log_mode);
}

template <typename T, int TPR, int ROWS>
MS_ROW_KERNEL_MIN(TPR * ROWS, 1) softmax_bwd_staged(const T* y, const T* dy, T* dx, i64 M, i64 N, i64 slice,
                                                   int log_mode) {
    softmax_bwd_staged_rows<T, TPR, ROWS, 1>(y, dy, dx, M, N, slice, log_mode);
}

#if __CUDA_ARCH__ >= 900
template <typename T, int TPR, int CLUSTER>
MS_CLUSTER_KERNEL(TPR, CLUSTER, 1) softmax_fwd_staged_cluster(const T* x, T* out, i64 M, i64 N, i64 slice,
                                                              int log_mode) {
    softmax_fwd_staged_rows<T, TPR, 1, CLUSTER>(x, out, M, N, slice, log_mode);
}

template <typename T, int TPR, int CLUSTER>
MS_CLUSTER_KERNEL(TPR, CLUSTER, 1) softmax_bwd_staged_cluster(const T* y, const T* dy, T* dx, i64 M, i64 N,
                                                              i64 slice, int log_mode) {
    softmax_bwd_staged_rows<T, TPR, 1, CLUSTER>(y, dy, dx, M, N, slice, log_mode);
}
#endif
