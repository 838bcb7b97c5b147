// Row softmax / log_softmax, forward and backward, with long rows split over blocks
// that find each other through global memory.
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
// kernels). Its settings: docs/tuning.md.
#include "common.cuh"

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
