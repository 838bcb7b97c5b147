// Shared device code of the CuPy backend: 16-bit storage types, conversions,
// vectorised tile loads and stores, warp/block/cluster reductions, softmax's
// gradient and the kernels' launch bounds.
// Needs no CUDA header: NVRTC builds it as it is, for sm_80 and newer.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define MS_INF __int_as_float(0x7f800000)
#define MS_NAN __int_as_float(0x7fffffff)
#define MS_FULL_MASK 0xffffffffu

// Raw 16-bit storage of torch.float16 and torch.bfloat16.
struct __align__(2) f16_t { u16 bits; };
struct __align__(2) bf16_t { u16 bits; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((u32)v.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

// 2^x with the hardware approximation (relative error ~2^-22); exp(x - m).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float exp_diff(float x, float m) { return exp2_approx((x - m) * 1.4426950408889634f); }

// The larger of a and b, NaN where either is NaN (fmaxf passes a NaN over): a row's max that carries a NaN
// makes every later step of the row NaN, as torch's softmax and cross-entropy are, wherever the NaN sits.
__device__ __forceinline__ float max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// exp(x - m) for the values x of a T tensor and one m that is one of them (their max), for many x. 16-bit
// values take one FFMA and ex2: 2^(x * log2(e) - shift), shift = m * log2(e) rounded. The rounding's residual
// (exact, from an FMA; below 1/16 while |m| < 2^20) is a factor common to every term, taken out once by
// `unshift`, so the terms are as exact as exp_diff's. From |m| = 2^20 on (bfloat16 only) every other value
// is at least 4096 away from m, its term 0 either way; the scale is then 1/16, which keeps m * scale exact.
// float32 values can be large with close neighbours, so they take exp_diff (x - m exact, then a multiply).
template <typename T>
struct ShiftedExp {
    float m, scale, shift, residual;
    __device__ __forceinline__ explicit ShiftedExp(float m_) : m(m_), scale(0.f), shift(0.f), residual(0.f) {
        if constexpr (sizeof(T) == 2) {
            scale = fabsf(m) < 1048576.f ? 1.4426950408889634f : 0.0625f;
            shift = m * scale;
            residual = fmaf(m, scale, -shift);
        }
    }
    __device__ __forceinline__ float operator()(float x) const {
        if constexpr (sizeof(T) == 2) return exp2_approx(fmaf(x, scale, -shift));
        else return exp_diff(x, m);
    }
    // A sum of terms (or a factor applied to them) -> the same for the exact exp(x - m).
    __device__ __forceinline__ float unshift(float v) const {
        if constexpr (sizeof(T) == 2) return v * exp2_approx(-residual);
        else return v;
    }
};

// The larger value of each 16-bit half of a and b, NaN where either is NaN: a 16-bit row's max without
// widening it (sm_80+).
template <typename T> __device__ __forceinline__ u32 max_pairs(u32 a, u32 b);
template <> __device__ __forceinline__ u32 max_pairs<bf16_t>(u32 a, u32 b) {
    u32 d;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
template <> __device__ __forceinline__ u32 max_pairs<f16_t>(u32 a, u32 b) {
    u32 d;
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Two floats as one word of two 16-bit values (lo in the low half), rounded to nearest even, in one instruction.
template <typename T> __device__ __forceinline__ u32 pack_pair(float lo, float hi);
template <> __device__ __forceinline__ u32 pack_pair<bf16_t>(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
template <> __device__ __forceinline__ u32 pack_pair<f16_t>(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Raw bits <-> float for each element type; 16-bit elements sit two to a
// 32-bit word (element 0 in the low half), as in memory.
template <typename T> struct Elem;
template <> struct Elem<float> {
    static constexpr int PER_WORD = 1;
    __device__ static __forceinline__ float get(u32 w, int) { return __uint_as_float(w); }
    __device__ static __forceinline__ u32 bits(float f) { return __float_as_uint(f); }
};
template <> struct Elem<bf16_t> {
    static constexpr int PER_WORD = 2;
    __device__ static __forceinline__ float get(u32 w, int half) {
        return __uint_as_float(half ? (w & 0xffff0000u) : (w << 16));
    }
    __device__ static __forceinline__ u32 bits(float f) { return from_float<bf16_t>(f).bits; }
};
template <> struct Elem<f16_t> {
    static constexpr int PER_WORD = 2;
    __device__ static __forceinline__ float get(u32 w, int half) {
        return to_float(f16_t{(u16)(half ? w >> 16 : w & 0xffffu)});
    }
    __device__ static __forceinline__ u32 bits(float f) { return from_float<f16_t>(f).bits; }
};

// ---------------------------------------------------------------------------
// Tiles: a group of TPR threads ("row group") covers TPR * VPT * VEC columns
// at a time; each thread keeps its EPT elements packed in registers (VPT
// 16-byte vectors). With `vec` (16-byte aligned rows whose column count is a
// multiple of VEC) each thread loads VPT 16-byte vectors, else EPT coalesced
// scalars. `map(col)` turns a logical column into an element offset from `base`.
// ---------------------------------------------------------------------------
template <typename T, int TPR, int VPT>
struct Tile {
    static constexpr int VEC = 16 / (int)sizeof(T);
    static constexpr int EPT = VPT * VEC;
    static constexpr int PER_WORD = Elem<T>::PER_WORD;
    static constexpr i64 SIZE = (i64)TPR * EPT;
    struct Regs {
        u32 w[VPT * 4];
    };

    __device__ static __forceinline__ float get(const Regs& r, int e) {
        return Elem<T>::get(r.w[e / PER_WORD], e % PER_WORD);
    }
    __device__ static __forceinline__ void put_bits(Regs& r, int e, u32 b) {
        if constexpr (PER_WORD == 1) {
            r.w[e] = b;
        } else {
            u32& w = r.w[e / 2];
            w = (e % 2) ? (w & 0xffffu) | (b << 16) : (w & 0xffff0000u) | (b & 0xffffu);
        }
    }
    __device__ static __forceinline__ void set(Regs& r, int e, float f) { put_bits(r, e, Elem<T>::bits(f)); }
    // The largest value held, NaN if any is (16-bit pairs compared as they are, without widening).
    __device__ static __forceinline__ float max_value(const Regs& r) {
        if constexpr (PER_WORD == 1) {
            float m = __uint_as_float(r.w[0]);
#pragma unroll
            for (int i = 1; i < VPT * 4; ++i) m = max_nan(m, __uint_as_float(r.w[i]));
            return m;
        } else {
            u32 m = r.w[0];
#pragma unroll
            for (int i = 1; i < VPT * 4; ++i) m = max_pairs<T>(m, r.w[i]);
            return max_nan(Elem<T>::get(m, 0), Elem<T>::get(m, 1));
        }
    }
    // Packs all EPT values at once (no read of the previous contents).
    __device__ static __forceinline__ void set_all(Regs& r, const float (&y)[EPT]) {
#pragma unroll
        for (int i = 0; i < VPT * 4; ++i) {
            if constexpr (PER_WORD == 1) r.w[i] = Elem<T>::bits(y[i]);
            else r.w[i] = (Elem<T>::bits(y[2 * i]) & 0xffffu) | (Elem<T>::bits(y[2 * i + 1]) << 16);
        }
    }

    // Logical column of this thread's element e in the tile starting at `start`:
    // start + offset(e) + lane * (vec ? VEC : 1).
    __device__ static __forceinline__ int offset(int e, bool vec) {
        return vec ? (e / VEC) * TPR * VEC + (e % VEC) : e * TPR;
    }
    __device__ static __forceinline__ i64 col(i64 start, int lane, int e, bool vec) {
        return start + offset(e, vec) + (i64)lane * (vec ? VEC : 1);
    }

    template <class Map>
    __device__ static __forceinline__ void load(Regs& r, const T* base, const Map& map, i64 start, i64 n, int lane,
                                                bool vec, float fill) {
        const u32 fill_bits = Elem<T>::bits(fill);
        const u32 fill_word = PER_WORD == 1 ? fill_bits : (fill_bits & 0xffffu) * 0x10001u;
        if (vec) {
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                i64 c = col(start, lane, k * VEC, true);
                uint4 q = make_uint4(fill_word, fill_word, fill_word, fill_word);
                if (c < n) q = *reinterpret_cast<const uint4*>(base + map(c));
                r.w[4 * k] = q.x; r.w[4 * k + 1] = q.y; r.w[4 * k + 2] = q.z; r.w[4 * k + 3] = q.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < EPT; ++e) {
                i64 c = col(start, lane, e, false);
                u32 b = fill_bits;
                if (c < n) {
                    if constexpr (PER_WORD == 1) b = reinterpret_cast<const u32*>(base)[map(c)];
                    else b = reinterpret_cast<const u16*>(base)[map(c)];
                }
                put_bits(r, e, b);
            }
        }
    }

    template <class Map>
    __device__ static __forceinline__ void store(const Regs& r, T* base, const Map& map, i64 start, i64 n, int lane,
                                                 bool vec) {
        if (vec) {
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                i64 c = col(start, lane, k * VEC, true);
                if (c < n)
                    *reinterpret_cast<uint4*>(base + map(c)) =
                        make_uint4(r.w[4 * k], r.w[4 * k + 1], r.w[4 * k + 2], r.w[4 * k + 3]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < EPT; ++e) {
                i64 c = col(start, lane, e, false);
                if (c < n) {
                    const u32 w = r.w[e / PER_WORD];
                    if constexpr (PER_WORD == 1) reinterpret_cast<u32*>(base)[map(c)] = w;
                    else reinterpret_cast<u16*>(base)[map(c)] = (u16)((e % 2) ? w >> 16 : w);
                }
            }
        }
    }
};

struct DenseMap {
    __device__ __forceinline__ i64 operator()(i64 c) const { return c; }
};

// ---------------------------------------------------------------------------
// Row statistics: running max `m` with sum `s` of exp(x - m), and two plain
// sums `a`, `b`. Combining is associative, so any reduction order works.
// ---------------------------------------------------------------------------
struct Stats {
    float m, s, a, b;
};

__device__ __forceinline__ Stats stats_empty() { return Stats{-MS_INF, 0.f, 0.f, 0.f}; }

__device__ __forceinline__ Stats stats_combine(Stats p, Stats q) {
    Stats r;
    r.m = max_nan(p.m, q.m);
    r.s = r.m == -MS_INF ? p.s + q.s : p.s * exp_diff(p.m, r.m) + q.s * exp_diff(q.m, r.m);
    r.a = p.a + q.a;
    r.b = p.b + q.b;
    return r;
}

// Moves the running max to at least `new_max`, rescaling the sum.
__device__ __forceinline__ Stats stats_shift(Stats p, float new_max) {
    float m = max_nan(p.m, new_max);
    p.s = m == -MS_INF ? p.s : p.s * exp_diff(p.m, m);
    p.m = m;
    return p;
}

// One value's max and sum over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(MS_FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(MS_FULL_MASK, v, o);
    return v;
}

template <int WIDTH>
__device__ __forceinline__ Stats warp_reduce(Stats v) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o /= 2) {
        Stats w;
        w.m = __shfl_xor_sync(MS_FULL_MASK, v.m, o);
        w.s = __shfl_xor_sync(MS_FULL_MASK, v.s, o);
        w.a = __shfl_xor_sync(MS_FULL_MASK, v.a, o);
        w.b = __shfl_xor_sync(MS_FULL_MASK, v.b, o);
        v = stats_combine(v, w);
    }
    return v;
}

// ---- asynchronous copies into shared memory (sm_80+) ----
// A 16-byte global -> shared copy that holds no register while in flight.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
    u32 addr = (u32)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(global) : "memory");
}
// Waits for this thread's copies (other threads' copies need a barrier as well).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- thread-block clusters (sm_90+) through PTX ----
__device__ __forceinline__ u32 cluster_rank() {
#if __CUDA_ARCH__ >= 900
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}

__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ float cluster_load(const float* local, u32 rank) {
#if __CUDA_ARCH__ >= 900
    u32 addr = (u32)__cvta_generic_to_shared(local), remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return *local;
#endif
}

// Reduction over the TPR threads of a row group. TPR <= 32: one warp (several
// row groups may share a block). TPR > 32: the whole block is one row group,
// and with CLUSTER > 1 the whole cluster is. Every thread of the row group
// gets the result. All threads of the block (cluster) must call it.
template <int TPR, int CLUSTER>
__device__ __forceinline__ Stats row_reduce(Stats v) {
    if constexpr (TPR <= 32) {
        return warp_reduce<TPR>(v);
    } else {
        constexpr int WARPS = TPR / 32;
        __shared__ Stats partial[WARPS];
        __shared__ Stats total;
        __shared__ float slot[4];
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        v = warp_reduce<32>(v);
        __syncthreads();  // earlier readers of `total` are done
        if (lane == 0) partial[warp] = v;
        __syncthreads();
        if (warp == 0) {
            Stats w = lane < WARPS ? partial[lane] : stats_empty();
            w = warp_reduce<32>(w);
            if (lane == 0) {
                total = w;
                slot[0] = w.m; slot[1] = w.s; slot[2] = w.a; slot[3] = w.b;
            }
        }
        if constexpr (CLUSTER > 1) {
            cluster_sync();  // every block's slot is written
            if (warp == 0) {
                Stats w = stats_empty();
                if (lane < CLUSTER) {
                    w.m = cluster_load(&slot[0], lane);
                    w.s = cluster_load(&slot[1], lane);
                    w.a = cluster_load(&slot[2], lane);
                    w.b = cluster_load(&slot[3], lane);
                }
                w = warp_reduce<32>(w);
                if (lane == 0) total = w;
            }
            cluster_sync();  // `total` is visible; no block reads a slot any more
        } else {
            __syncthreads();
        }
        return total;
    }
}

// Softmax's gradient (softmax_rows.cu, softmax_staged.cu, softmax_split.cu) from y, dy and the row's dot
// product (sum(dy) for log_softmax, sum(y * dy) for softmax).
__device__ __forceinline__ float softmax_gradient(float y, float dy, float dot, int log_mode) {
    return log_mode ? dy - exp_diff(y, 0.f) * dot : y * (dy - dot);
}

// Launch bounds and, for CLUSTER > 1, the compile-time cluster shape. MIN_BLOCKS
// resident blocks per multiprocessor cap the registers; 0 takes the default:
// 512-thread blocks are held to 64 registers so that two fit on a multiprocessor.
#define MS_MIN_BLOCKS(THREADS) ((THREADS) == 512 ? 2 : 1)
#define MS_BLOCKS_OR_DEFAULT(THREADS, MIN_BLOCKS) ((MIN_BLOCKS) > 0 ? (MIN_BLOCKS) : MS_MIN_BLOCKS(THREADS))
#define MS_ROW_KERNEL_MIN(THREADS, MIN_BLOCKS) \
    __global__ void __launch_bounds__(THREADS, MS_BLOCKS_OR_DEFAULT(THREADS, MIN_BLOCKS))
#define MS_ROW_KERNEL(THREADS) MS_ROW_KERNEL_MIN(THREADS, 0)
#define MS_CLUSTER_KERNEL(THREADS, CLUSTER, MIN_BLOCKS) \
    __global__ void __cluster_dims__(CLUSTER, 1, 1)     \
        __launch_bounds__(THREADS, MS_BLOCKS_OR_DEFAULT(THREADS, MIN_BLOCKS))
