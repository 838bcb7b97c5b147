// Row softmax / log_softmax, forward and backward, with the rows staged in shared memory.
// Each block copies its slice of a row (with CLUSTER > 1, one of the cluster's consecutive slices) into shared
// memory with cp.async and works on it there, so the bytes a multiprocessor has in flight are bounded by its shared
// memory (up to 227 KB) rather than by registers, which hold 16-bit data as floats. The cluster combines its
// statistics through distributed shared memory. A thread reads back only the vectors it copied, so the copies need
// no barrier. A row group of TPR threads works on a row: a block (TPR > 32: ROWS = 1, and with CLUSTER > 1 the
// cluster) or a warp (TPR = 32: ROWS rows per block). Needs N % VEC == 0, 16-byte aligned rows and a `slice` that is
// a multiple of VEC; dynamic shared memory: ROWS x staged tensors x slice elements.
#include "common.cuh"

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

// The largest value of the vectors (lane, lane + TPR, ...) of `xs`; 16-bit pairs compared as they are.
template <typename T, int TPR>
__device__ __forceinline__ float staged_max(const uint4* xs, int vectors, int lane) {
    using S = Staged<T>;
    if constexpr (S::V::PER_WORD == 2) {
        const u32 none = (Elem<T>::bits(-MS_INF) & 0xffffu) * 0x10001u;
        u32 m = none;
        for (int i = lane; i < vectors; i += TPR) {
            const uint4 q = xs[i];
            m = max_pairs<T>(m, max_pairs<T>(max_pairs<T>(q.x, q.y), max_pairs<T>(q.z, q.w)));
        }
        return max_nan(Elem<T>::get(m, 0), Elem<T>::get(m, 1));
    } else {
        float m = -MS_INF;
        for (int i = lane; i < vectors; i += TPR) {
            const auto r = S::regs(xs[i]);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) m = max_nan(m, S::V::get(r, e));
        }
        return m;
    }
}

// What a row group's staged slice contributes, from the vectors (lane, lane + TPR, ...) of `xs`: forward,
// the max and the sum of exp(x - max) (this thread's share); backward, sum(y * dy) or, for log_softmax, sum(dy).
template <typename T, int TPR>
__device__ __forceinline__ Stats staged_statistics(const uint4* xs, int vectors, int lane) {
    using S = Staged<T>;
    Stats st = stats_empty();
    st.m = staged_max<T, TPR>(xs, vectors, lane);
    if (st.m != -MS_INF) {
        const ShiftedExp<T> ex(st.m);
        float s = 0.f;
        for (int i = lane; i < vectors; i += TPR) {
            const auto r = S::regs(xs[i]);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) s += ex(S::V::get(r, e));
        }
        st.s = ex.unshift(s);
    }
    return st;
}

template <typename T, int TPR>
__device__ __forceinline__ float staged_dot(const uint4* ys, const uint4* ds, int vectors, int lane, int log_mode) {
    using S = Staged<T>;
    float acc = 0.f;
    for (int i = lane; i < vectors; i += TPR) {
        const auto ry = S::regs(ys[i]), rd = S::regs(ds[i]);
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) acc += log_mode ? S::V::get(rd, e) : S::V::get(ry, e) * S::V::get(rd, e);
    }
    return acc;
}

// Writes softmax (or log_softmax) of the staged slice to `dst`, given the row's max and sum of exp(x - max).
template <typename T, int TPR>
__device__ __forceinline__ void staged_normalise(const uint4* xs, T* dst, int vectors, int lane, Stats row,
                                                 int log_mode) {
    using S = Staged<T>;
    const float log_sum = logf(row.s);
    const ShiftedExp<T> ex(row.m);
    const float inv_sum = ex.unshift(1.f / row.s);
    uint4* to = reinterpret_cast<uint4*>(dst);
#pragma unroll 2
    for (int i = lane; i < vectors; i += TPR) {
        const auto r = S::regs(xs[i]);
        float f[S::VEC];
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) {
            const float in = S::V::get(r, e);
            f[e] = log_mode ? (in - row.m) - log_sum : ex(in) * inv_sum;
        }
        to[i] = S::pack(f);
    }
}

// Writes the gradient of the staged slice to `dst`, given the row's dot (see staged_dot).
template <typename T, int TPR>
__device__ __forceinline__ void staged_gradient(const uint4* ys, const uint4* ds, T* dst, int vectors, int lane,
                                                float dot, int log_mode) {
    using S = Staged<T>;
    uint4* to = reinterpret_cast<uint4*>(dst);
    for (int i = lane; i < vectors; i += TPR) {
        const auto ry = S::regs(ys[i]), rd = S::regs(ds[i]);
        float f[S::VEC];
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) {
            const float fy = S::V::get(ry, e), fd = S::V::get(rd, e);
            f[e] = softmax_gradient(fy, fd, dot, log_mode);
        }
        to[i] = S::pack(f);
    }
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
        const Stats st = row_reduce<TPR, CLUSTER>(staged_statistics<T, TPR>(xs, vectors, lane));
        staged_normalise<T, TPR>(xs, out + row * N + begin, vectors, lane, st, log_mode);
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
        Stats st = stats_empty();
        st.a = staged_dot<T, TPR>(ys, ds, vectors, lane, log_mode);
        const float dot = row_reduce<TPR, CLUSTER>(st).a;
        staged_gradient<T, TPR>(ys, ds, dx + row * N + begin, vectors, lane, dot, log_mode);
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
