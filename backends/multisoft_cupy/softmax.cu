// Row softmax / log_softmax, forward and backward.
// A row is split into tiles; block `rank` of a cluster (0 without clusters)
// owns tiles rank, rank + CLUSTER, ... A row that fits in one tile per block
// is read once and kept in registers; longer rows are re-read (newest tiles
// first, so they tend to come from L2) for the second pass. Further down:
// rows staged in shared memory, and long rows split over blocks that wait for
// each other through global memory.
#include "common.cuh"

// A gradient from y, dy and the row's dot product (sum(dy) for log_softmax, sum(y * dy) for softmax).
__device__ __forceinline__ float softmax_gradient(float y, float dy, float dot, int log_mode) {
    return log_mode ? dy - exp_diff(y, 0.f) * dot : y * (dy - dot);
}

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
        return fmaxf(Elem<T>::get(m, 0), Elem<T>::get(m, 1));
    } else {
        float m = -MS_INF;
        for (int i = lane; i < vectors; i += TPR) {
            const auto r = S::regs(xs[i]);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) m = fmaxf(m, S::V::get(r, e));
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

// ---------------------------------------------------------------------------
// Long rows split over blocks that find each other through global memory.
// Each block takes a ticket, its start order, from counters[0]: its row is
// ticket / chunks, its chunk ticket % chunks, of THREADS x VPT x VEC columns,
// which it holds in registers as loaded (16-bit values stay packed). It
// publishes what the chunk contributes to the row in `partial` (2 floats per
// ticket forward, 1 backward), counts itself on the row's counter,
// counters[(row + 1) * MS_COUNTER_STRIDE], and waits for the row's other
// chunks. Tickets in start order make the wait safe: only the newest row can
// have chunks that have not started, so a row needs no more chunks than
// blocks that can run at once (the caller keeps chunks <= the multiprocessor
// count). Needs zeroed counters; any N and alignment (`vec_ok` as in the row
// kernels). Measured on an H200 (tuning/cupy-split-round1..2.txt), chunks
// staged in shared memory instead were slower.
// ---------------------------------------------------------------------------
#define MS_COUNTER_STRIDE 32  // one 128-byte line per row counter

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float load_relaxed(const float* p) {
    float v;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int take_ticket(int* counters) {
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(counters, 1);
    __syncthreads();
    return ticket;
}

// Thread 0, having written this block's partial results, counts the block at `counter` and waits until
// `expected` blocks have; then the whole block may read the others' partial results.
__device__ __forceinline__ void arrive_and_wait(int* counter, int expected) {
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1);
        while (load_acquire(counter) < expected) {
        }
    }
    __syncthreads();
}

// The split forward of one block. softmax keeps exp(x - the thread's max) as floats for the output, which is
// then that times exp(thread max - row max) / sum: one exponential per element (log_softmax needs one anyway).
template <typename T, int THREADS, int VPT, bool LOG>
__device__ __forceinline__ void split_forward(const T* x, T* out, float* partial, int* counters, i64 N, int chunks,
                                              bool vec) {
    using TL = Tile<T, THREADS, VPT>;
    const int ticket = take_ticket(counters);
    const i64 row = ticket / chunks, start = (i64)(ticket % chunks) * TL::SIZE;
    const DenseMap map;
    typename TL::Regs v;
    TL::load(v, x + row * N, map, start, N, threadIdx.x, vec, -MS_INF);
    Stats own = stats_empty();
    own.m = TL::max_value(v);
    const float thread_max = own.m;
    const ShiftedExp<T> ex(own.m == -MS_INF ? 0.f : own.m);  // -inf only: exp(-inf - 0) = 0
    float f[TL::EPT];
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < TL::EPT; ++e) {
        const float term = ex(TL::get(v, e));
        if constexpr (!LOG) f[e] = term;
        s += term;
    }
    own.s = ex.unshift(s);
    own = row_reduce<THREADS, 1>(own);
    if (threadIdx.x == 0) {
        partial[2 * (i64)ticket] = own.m;
        partial[2 * (i64)ticket + 1] = own.s;
    }
    arrive_and_wait(counters + (row + 1) * MS_COUNTER_STRIDE, chunks);
    Stats st = stats_empty();
    for (int p = threadIdx.x % 32; p < chunks; p += 32) {
        Stats q = stats_empty();
        q.m = load_relaxed(partial + 2 * (row * chunks + p));
        q.s = load_relaxed(partial + 2 * (row * chunks + p) + 1);
        st = stats_combine(st, q);
    }
    st = warp_reduce<32>(st);
    if constexpr (LOG) {
        const float log_sum = logf(st.s);
#pragma unroll
        for (int e = 0; e < TL::EPT; ++e) f[e] = (TL::get(v, e) - st.m) - log_sum;
    } else {
        // exp(thread max - row max) / sum: 0 for a thread of -inf only, NaN for a row of -inf only, as torch
        const float scale = ex.unshift(exp_diff(thread_max, st.m) / st.s);
#pragma unroll
        for (int e = 0; e < TL::EPT; ++e) f[e] *= scale;
    }
    TL::set_all(v, f);
    TL::store(v, out + row * N, map, start, N, threadIdx.x, vec);
}

template <typename T, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) softmax_fwd_split(const T* x, T* out, float* partial,
                                                                  int* counters, i64 N, int chunks, int log_mode,
                                                                  int vec_ok) {
    if (log_mode) split_forward<T, THREADS, VPT, true>(x, out, partial, counters, N, chunks, vec_ok != 0);
    else split_forward<T, THREADS, VPT, false>(x, out, partial, counters, N, chunks, vec_ok != 0);
}

template <typename T, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) softmax_bwd_split(const T* y, const T* dy, T* dx, float* partial,
                                                                  int* counters, i64 N, int chunks, int log_mode,
                                                                  int vec_ok) {
    using TL = Tile<T, THREADS, VPT>;
    const int ticket = take_ticket(counters);
    const i64 row = ticket / chunks, start = (i64)(ticket % chunks) * TL::SIZE, base = row * N;
    const DenseMap map;
    typename TL::Regs vy, vd;
    TL::load(vy, y + base, map, start, N, threadIdx.x, vec_ok != 0, 0.f);
    TL::load(vd, dy + base, map, start, N, threadIdx.x, vec_ok != 0, 0.f);
    Stats own = stats_empty();
#pragma unroll
    for (int e = 0; e < TL::EPT; ++e) own.a += log_mode ? TL::get(vd, e) : TL::get(vy, e) * TL::get(vd, e);
    own = row_reduce<THREADS, 1>(own);
    if (threadIdx.x == 0) partial[ticket] = own.a;
    arrive_and_wait(counters + (row + 1) * MS_COUNTER_STRIDE, chunks);
    float dot = 0.f;
    for (int p = threadIdx.x % 32; p < chunks; p += 32) dot += load_relaxed(partial + row * chunks + p);
    dot = warp_sum(dot);
    float out[TL::EPT];
#pragma unroll
    for (int e = 0; e < TL::EPT; ++e) {
        const float fy = TL::get(vy, e), fd = TL::get(vd, e);
        out[e] = softmax_gradient(fy, fd, dot, log_mode);
    }
    TL::set_all(vd, out);
    TL::store(vd, dx + base, map, start, N, threadIdx.x, vec_ok != 0);
}
