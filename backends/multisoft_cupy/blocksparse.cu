// Block-sparse softmax over the compressed blocks (Z, nnz, B, B).
// Row i of block-row hr (= h * Mb + r) is the concatenation of row i of the blocks offsets[hr] .. offsets[hr + 1].
// A warp per row; rows are numbered (z, hr, i). The row is read as VEC-element vectors (16 bytes), each inside
// one block. A warp step covers 32 vectors, WB = 32 / VPB whole blocks (VPB = B / VEC vectors per block row), so
// lane `lane` reads the same column of block s * WB + lane / VPB at step s: its vectors lie one stride apart. A
// thread holds VPT steps (a tile). A row of one tile is read once and written from registers; a longer row reads
// its tiles again (the last one excepted).
#include "common.cuh"

template <typename T>
struct BsVec {
    static constexpr int VEC = 16 / (int)sizeof(T);
    static constexpr int LOG2VEC = VEC == 4 ? 2 : 3;

    // The VEC elements at p as raw words: one 16-byte load when VECTOR, else element by element.
    template <bool VECTOR>
    __device__ static __forceinline__ uint4 load(const T* p) {
        if constexpr (VECTOR) {
            return *reinterpret_cast<const uint4*>(p);
        } else if constexpr (Elem<T>::PER_WORD == 1) {
            const u32* q = reinterpret_cast<const u32*>(p);
            return make_uint4(q[0], q[1], q[2], q[3]);
        } else {
            const u16* q = reinterpret_cast<const u16*>(p);
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) w[i] = (u32)q[2 * i] | ((u32)q[2 * i + 1] << 16);
            return make_uint4(w[0], w[1], w[2], w[3]);
        }
    }

    template <bool VECTOR>
    __device__ static __forceinline__ void store(T* p, const float (&f)[VEC]) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (Elem<T>::PER_WORD == 1) w[i] = Elem<T>::bits(f[i]);
            else w[i] = (Elem<T>::bits(f[2 * i]) & 0xffffu) | (Elem<T>::bits(f[2 * i + 1]) << 16);
        }
        if constexpr (VECTOR) {
            *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
        } else if constexpr (Elem<T>::PER_WORD == 1) {
            u32* q = reinterpret_cast<u32*>(p);
#pragma unroll
            for (int i = 0; i < 4; ++i) q[i] = w[i];
        } else {
            u16* q = reinterpret_cast<u16*>(p);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                q[2 * i] = (u16)w[i];
                q[2 * i + 1] = (u16)(w[i] >> 16);
            }
        }
    }

    __device__ static __forceinline__ float get(const uint4& q, int e) {
        const u32 w = e / Elem<T>::PER_WORD == 0 ? q.x : e / Elem<T>::PER_WORD == 1 ? q.y
                    : e / Elem<T>::PER_WORD == 2 ? q.z : q.w;
        return Elem<T>::get(w, e % Elem<T>::PER_WORD);
    }

    __device__ static __forceinline__ uint4 splat(float f) {
        const u32 b = Elem<T>::bits(f);
        const u32 w = Elem<T>::PER_WORD == 1 ? b : (b & 0xffffu) * 0x10001u;
        return make_uint4(w, w, w, w);
    }
};

// a / b and a % b, in 32 bits when both fit.
__device__ __forceinline__ void divmod(i64 a, i64 b, i64& q, i64& r) {
    if (((a | b) >> 32) == 0) {
        const u32 q32 = (u32)a / (u32)b;
        q = q32;
        r = (u32)a - q32 * (u32)b;
    } else {
        q = a / b;
        r = a - q * b;
    }
}

// One lane's share of one row: its vector of step s is at element offset(s) when has(s).
struct BsRow {
    i64 lane_offset;  // this lane's vector at step 0
    i64 stride;       // elements between a lane's steps (WB blocks)
    int first;        // the block-row's first block (index into columns[])
    int blocks;       // blocks in the row
    int wb, log2wb;   // blocks per step
    int lane_block;   // the lane's block within a step
    int col;          // the lane's first column inside a block
    int abs_row;      // r * B + i: the row's place in the attention matrix (for causal masks)

    __device__ __forceinline__ int block(int s) const { return s * wb + lane_block; }
    __device__ __forceinline__ bool has(int s) const { return block(s) < blocks; }
    __device__ __forceinline__ i64 offset(int s) const { return lane_offset + (i64)s * stride; }
    // Tiles of VPT steps that hold the row.
    template <int VPT>
    __device__ __forceinline__ int tiles() const {
        const u32 steps = ((u32)blocks + wb - 1) >> log2wb;
        return (int)((steps + VPT - 1) / VPT);
    }
};

template <int LOG2VEC>
__device__ __forceinline__ BsRow bs_row(const int* offsets, i64 rid, i64 nnz, i64 groups, int block_rows, int log2b,
                                        int lane) {
    const int log2vpb = log2b - LOG2VEC;
    i64 z, hr, r_, unused;
    divmod(rid >> log2b, groups, z, hr);
    divmod(hr, block_rows, unused, r_);
    const int i = (int)(rid & ((1 << log2b) - 1));
    const int o0 = offsets[hr], o1 = offsets[hr + 1];
    BsRow row;
    row.first = o0;
    row.blocks = o1 - o0;
    row.log2wb = 5 - log2vpb;
    row.wb = 1 << row.log2wb;
    row.lane_block = lane >> log2vpb;
    row.col = (lane & ((1 << log2vpb) - 1)) << LOG2VEC;
    row.stride = (i64)row.wb << (2 * log2b);
    row.lane_offset = ((z * nnz + o0 + row.lane_block) << (2 * log2b)) + ((i64)i << log2b) + row.col;
    row.abs_row = (int)(r_ << log2b) + i;
    return row;
}

// softmax(scale * x) of one row. MASKED: masked elements (causal, past the row's end) are chosen element by
// element, for any scale; else the vectors past the row's end are filled with a value that scale takes to -inf
// (scale != 0).
template <typename T, int VPT, bool VECTOR, bool MASKED>
__device__ __forceinline__ void bs_fwd_row(const T* x, T* out, const BsRow& row, const int* columns, int log2b,
                                           float scale, bool causal) {
    using V = BsVec<T>;
    constexpr int VEC = V::VEC;
    const uint4 fill = V::splat(scale > 0.f ? -MS_INF : MS_INF);
    const int ntiles = row.template tiles<VPT>();
    float f[VPT][VEC];
    // scale * x, -inf where masked
    auto scores = [&](int t) {
        uint4 q[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            q[k] = fill;
            if (row.has(t * VPT + k)) q[k] = V::template load<VECTOR>(x + row.offset(t * VPT + k));
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            int keep = VEC;  // elements 0 .. keep - 1 are scores
            if constexpr (MASKED) {
                const int s = t * VPT + k;
                keep = row.has(s) ? VEC : 0;
                if (causal && keep) {
                    const int col = (columns[row.first + row.block(s)] << log2b) + row.col;
                    keep = max(0, min(VEC, row.abs_row - col + 1));
                }
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float v = V::get(q[k], e) * scale;
                f[k][e] = !MASKED || e < keep ? v : -MS_INF;
            }
        }
    };
    // Pass 1: running max m and sum s; f ends as exp(score - m) of the last tile (times fix, see ShiftedExp).
    float m = -MS_INF, s = 0.f, fix = 1.f;
    for (int t = 0; t < ntiles; ++t) {
        scores(t);
        const float m_old = m;
        float tile_max = -MS_INF;
#pragma unroll
        for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) tile_max = fmaxf(tile_max, f[k][e]);
        m = fmaxf(m, tile_max);
        const float shift = m == -MS_INF ? 0.f : m;  // nothing but masked elements so far: exp(-inf - 0) = 0
        s *= exp_diff(m_old, shift);
        const ShiftedExp<T> ex(shift);
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                f[k][e] = ex(f[k][e]);
                acc += f[k][e];
            }
        fix = ex.unshift(1.f);
        s += acc * fix;
    }
    const float row_max = warp_max(m);
    if (row_max == -MS_INF) {  // every element masked: zeros
#pragma unroll
        for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[k][e] = 0.f;
        for (int t = 0; t < ntiles; ++t)
#pragma unroll
            for (int k = 0; k < VPT; ++k)
                if (row.has(t * VPT + k)) V::template store<VECTOR>(out + row.offset(t * VPT + k), f[k]);
        return;
    }
    const float inv_sum = 1.f / warp_sum(m == -MS_INF ? 0.f : s * exp_diff(m, row_max));
    // Pass 2: the last tile from registers, the others read again.
    const float last_factor = m == -MS_INF ? 0.f : exp_diff(m, row_max) * inv_sum * fix;
    const int last = ntiles - 1;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        if (!row.has(last * VPT + k)) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[k][e] *= last_factor;
        V::template store<VECTOR>(out + row.offset(last * VPT + k), f[k]);
    }
    if (last < 1) return;
    const ShiftedExp<T> ex(row_max);
    const float fixed_inv_sum = ex.unshift(inv_sum);
    for (int t = last - 1; t >= 0; --t) {
        scores(t);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[k][e] = ex(f[k][e]) * fixed_inv_sum;
            V::template store<VECTOR>(out + row.offset(t * VPT + k), f[k]);  // every step of a full tile is there
        }
    }
}

template <typename T, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) bs_fwd(const T* x, T* out, const int* offsets, const int* columns, i64 Z, i64 nnz,
                                 i64 groups, int block_rows, int log2b, float scale, int causal, int vec_ok) {
    static_assert(TPR == 32, "a warp per row");
    const int lane = threadIdx.x % 32;
    const i64 total_rows = (Z * groups) << log2b;
    const bool masked = causal != 0 || scale == 0.f;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / 32; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BsRow row = bs_row<BsVec<T>::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b, lane);
        if (vec_ok) {
            if (masked) bs_fwd_row<T, VPT, true, true>(x, out, row, columns, log2b, scale, causal != 0);
            else bs_fwd_row<T, VPT, true, false>(x, out, row, columns, log2b, scale, false);
        } else {
            if (masked) bs_fwd_row<T, VPT, false, true>(x, out, row, columns, log2b, scale, causal != 0);
            else bs_fwd_row<T, VPT, false, false>(x, out, row, columns, log2b, scale, false);
        }
    }
}

// dx = scale * y * (dy - sum_row(y * dy)) of one row; the last tile stays in registers as raw words.
template <typename T, int VPT, bool VECTOR>
__device__ __forceinline__ void bs_bwd_row(const T* y, const T* dy, T* dx, const BsRow& row, float scale) {
    using V = BsVec<T>;
    constexpr int VEC = V::VEC;
    const int ntiles = row.template tiles<VPT>();
    uint4 qy[VPT], qd[VPT];
    auto load = [&](int t) {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            qy[k] = qd[k] = make_uint4(0u, 0u, 0u, 0u);
            if (row.has(t * VPT + k)) {
                qy[k] = V::template load<VECTOR>(y + row.offset(t * VPT + k));
                qd[k] = V::template load<VECTOR>(dy + row.offset(t * VPT + k));
            }
        }
    };
    float acc = 0.f;
    for (int t = 0; t < ntiles; ++t) {
        load(t);
#pragma unroll
        for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc += V::get(qy[k], e) * V::get(qd[k], e);
    }
    const float dot = warp_sum(acc);
    for (int t = ntiles - 1; t >= 0; --t) {
        if (t != ntiles - 1) load(t);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            if (!row.has(t * VPT + k)) continue;
            float g[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) g[e] = scale * V::get(qy[k], e) * (V::get(qd[k], e) - dot);
            V::template store<VECTOR>(dx + row.offset(t * VPT + k), g);
        }
    }
}

template <typename T, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) bs_bwd(const T* y, const T* dy, T* dx, const int* offsets, i64 Z, i64 nnz, i64 groups,
                                 int block_rows, int log2b, float scale, int vec_ok) {
    static_assert(TPR == 32, "a warp per row");
    const int lane = threadIdx.x % 32;
    const i64 total_rows = (Z * groups) << log2b;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / 32; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BsRow row = bs_row<BsVec<T>::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b, lane);
        if (vec_ok) bs_bwd_row<T, VPT, true>(y, dy, dx, row, scale);
        else bs_bwd_row<T, VPT, false>(y, dy, dx, row, scale);
    }
}
