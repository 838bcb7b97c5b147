// Block-sparse softmax over the compressed blocks (Z, nnz, B, B).
// Row i of block-row hr (= h * Mb + r) is the concatenation of row i of the blocks offsets[hr] .. offsets[hr + 1].
// Register kernels: a row takes LANES lanes (32, or fewer in the backward: several rows of one block-row a warp);
// rows are numbered (z, hr, i). The row is read as VEC-element vectors (16 bytes), each inside one block. A step of
// the row's lanes covers LANES vectors, WB = LANES / VPB whole blocks (VPB = B / VEC vectors per block row), so
// lane `lane` reads the same column of block s * WB + lane / VPB at step s: its vectors lie one stride apart. A
// thread holds VPT steps (a tile). A row of one tile is read once and written from registers; a longer row reads
// its tiles again (the last one excepted).
// Non-finite scores (backends/README.md): a row's unmasked elements get what dense softmax gives over them, NaN
// throughout for a NaN or +inf among them or when all are -inf (the shift guards only a max of -inf; the sum is
// divided unguarded; fmaxf passes NaN over, but a NaN term makes the sum NaN), masked elements 0 (set again in a
// row that comes out NaN, where their terms are NaN too); a row with no unmasked element, known from the causal
// prefix, zeros. The backward gives 0 wherever y is 0.
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

// The max and sum of one value over each aligned group of `lanes` lanes (a power of two), every lane of the warp
// taking part; and the max over the warp of one int that is the same across each group.
__device__ __forceinline__ float group_max(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(MS_FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float group_sum(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(MS_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ int groups_max(int v, int lanes) {
    for (int o = 16; o >= lanes; o /= 2) v = max(v, __shfl_xor_sync(MS_FULL_MASK, v, o));
    return v;
}

// One lane's share of one row: its vector of step s is at element offset(s) when has(s).
struct BsRow {
    i64 lane_offset;  // this lane's vector at step 0
    i64 stride;       // elements between a lane's steps (WB blocks)
    int first;        // the block-row's first block (index into columns[])
    int blocks;       // blocks in the row
    int wb, log2wb;   // blocks per step (lanes / (B / VEC))
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

// Row rid's share for lane `lane` of the row's 2^log2lanes lanes (at least the B / VEC vectors of a block's row).
template <int LOG2VEC>
__device__ __forceinline__ BsRow bs_row(const int* offsets, i64 rid, i64 nnz, i64 groups, int block_rows, int log2b,
                                        int lane, int log2lanes) {
    const int log2vpb = log2b - LOG2VEC;
    i64 z, hr, r_, unused;
    divmod(rid >> log2b, groups, z, hr);
    divmod(hr, block_rows, unused, r_);
    const int i = (int)(rid & ((1 << log2b) - 1));
    const int o0 = offsets[hr], o1 = offsets[hr + 1];
    BsRow row;
    row.first = o0;
    row.blocks = o1 - o0;
    row.log2wb = log2lanes - log2vpb;
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
    // Elements 0 .. kept(s) - 1 of the lane's vector at step s are unmasked: none past the row's end, with causal
    // those up to the diagonal.
    auto kept = [&](int s) {
        int keep = row.has(s) ? VEC : 0;
        if (causal && keep) {
            const int col = (columns[row.first + row.block(s)] << log2b) + row.col;
            keep = max(0, min(VEC, row.abs_row - col + 1));
        }
        return keep;
    };
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
            if constexpr (MASKED) keep = kept(t * VPT + k);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float v = V::get(q[k], e) * scale;
                f[k][e] = !MASKED || e < keep ? v : -MS_INF;
            }
        }
    };
    // 0 for the masked elements of the lane's vector k of tile t (their terms are NaN in a row that is NaN)
    auto remask = [&](int t, int k) {
        const int keep = kept(t * VPT + k);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            if (e >= keep) f[k][e] = 0.f;
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
    // nothing unmasked (no block, or causal and the first block past the diagonal): zeros
    if (row.blocks == 0 || (causal && (columns[row.first] << log2b) > row.abs_row)) {
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
    // Only a max of -inf is not the shift (every score -inf: terms 0, 1 / 0, and 0 * inf = NaN throughout). A lane
    // of -inf only has a sum of 0, or NaN where it holds a NaN (fmaxf passed it over): every lane's sum counts.
    const float row_shift = row_max == -MS_INF ? 0.f : row_max;
    const float sum = warp_sum(s * exp_diff(m, row_shift));
    const float inv_sum = 1.f / sum;
    const bool nan_row = MASKED && causal && !(fabsf(row_max) < MS_INF && sum == sum);
    // Pass 2: the last tile from registers, the others read again.
    const float last_factor = exp_diff(m, row_shift) * inv_sum * fix;
    const int last = ntiles - 1;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        if (!row.has(last * VPT + k)) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[k][e] *= last_factor;
        if (nan_row) remask(last, k);
        V::template store<VECTOR>(out + row.offset(last * VPT + k), f[k]);
    }
    if (last < 1) return;
    const ShiftedExp<T> ex(row_shift);
    const float fixed_inv_sum = ex.unshift(inv_sum);
    for (int t = last - 1; t >= 0; --t) {
        scores(t);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[k][e] = ex(f[k][e]) * fixed_inv_sum;
            if (nan_row) remask(t, k);
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
        const BsRow row = bs_row<BsVec<T>::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b, lane, 5);
        if (vec_ok) {
            if (masked) bs_fwd_row<T, VPT, true, true>(x, out, row, columns, log2b, scale, causal != 0);
            else bs_fwd_row<T, VPT, true, false>(x, out, row, columns, log2b, scale, false);
        } else {
            if (masked) bs_fwd_row<T, VPT, false, true>(x, out, row, columns, log2b, scale, causal != 0);
            else bs_fwd_row<T, VPT, false, false>(x, out, row, columns, log2b, scale, false);
        }
    }
}

// dx = scale * y * (dy - sum_row(y * dy)) of one row, 0 wherever y is 0 (also in a row whose sum is NaN); the last
// tile stays in registers as raw words.
template <typename T, int VPT, bool VECTOR>
__device__ __forceinline__ void bs_bwd_row(const T* y, const T* dy, T* dx, const BsRow& row, float scale, int lanes) {
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
    const float dot = group_sum(acc, lanes);
    for (int t = ntiles - 1; t >= 0; --t) {
        if (t != ntiles - 1) load(t);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            if (!row.has(t * VPT + k)) continue;
            float g[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float p = V::get(qy[k], e);
                g[e] = p == 0.f ? 0.f : scale * p * (V::get(qd[k], e) - dot);
            }
            V::template store<VECTOR>(dx + row.offset(t * VPT + k), g);
        }
    }
}

// 2^log2lanes lanes a row, taken at launch (32 / lanes rows of one block-row a warp, ROWS warps a block).
template <typename T, int TPR, int ROWS, int VPT, int MIN_BLOCKS = 0>
MS_ROW_KERNEL_MIN(TPR * ROWS, MIN_BLOCKS) bs_bwd(const T* y, const T* dy, T* dx, const int* offsets, i64 Z, i64 nnz, i64 groups,
                                 int block_rows, int log2b, float scale, int vec_ok, int log2lanes) {
    static_assert(TPR == 32, "warps of rows");
    const int lanes = 1 << log2lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const int per_block = ROWS << (5 - log2lanes);
    const i64 total_rows = (Z * groups) << log2b;
    for (i64 rid = (i64)blockIdx.x * per_block + (threadIdx.x >> log2lanes); rid < total_rows;
         rid += (i64)gridDim.x * per_block) {
        const BsRow row = bs_row<BsVec<T>::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b, lane, log2lanes);
        if (vec_ok) bs_bwd_row<T, VPT, true>(y, dy, dx, row, scale, lanes);
        else bs_bwd_row<T, VPT, false>(y, dy, dx, row, scale, lanes);
    }
}

// ---------------------------------------------------------------------------
// Rows staged in shared memory (sm_80+, 16-byte aligned blocks), forward. LANES lanes per row (a power of two up to
// 32; 32 / LANES rows of one block-row per warp) copy the row's vectors that hold a kept element (a causal row's
// prefix, lut.causal) into a buffer of the row's own (CAP vectors) with cp.async and work there, so the bytes in
// flight are bounded by shared memory rather than by registers, and a row of up to CAP vectors is read from global
// memory once, whatever its length; a longer row is staged CAP vectors at a time, twice. Zeros are written past the
// kept prefix without reading. A lane reads back only the vectors it copied, so the copies need no barrier. Fewer
// lanes per row spread a row's fixed costs (its set-up, its reductions) over more of its elements.
// ---------------------------------------------------------------------------
template <int LOG2VEC>
struct BsStagedRow {
    i64 base;     // element offset of the row in block 0
    int log2b;
    int vectors;  // VEC-element vectors in the row
    int kept;     // elements kept (a prefix of the row)

    // Element offset of the row's vector v.
    __device__ __forceinline__ i64 offset(int v) const {
        const int log2vpb = log2b - LOG2VEC;
        return base + ((i64)(v >> log2vpb) << (2 * log2b)) + ((v & ((1 << log2vpb) - 1)) << LOG2VEC);
    }

    // The row's vectors v, v + lanes, v + 2 lanes, ... in tensor t, a step at a time: `p` points at the current
    // one. A step moves `lanes` vectors along the row, carrying into the next blocks (B * B - B elements on from a
    // block's row piece's end) where it passes a block's B elements: a few 32-bit operations and one wide add, where
    // offset() takes a dozen 64-bit operations per vector.
    template <typename P>
    struct Walk {
        P* p;
        int in_block;  // the current vector's place in its block's row piece
        int lanes, log2vpb, jump;

        __device__ __forceinline__ void next() {
            const int q = in_block + lanes;
            p += (lanes << LOG2VEC) + (q >> log2vpb) * jump;
            in_block = q & ((1 << log2vpb) - 1);
        }
    };

    template <typename P>
    __device__ __forceinline__ Walk<P> walk(P* t, int v, int lanes) const {
        const int log2vpb = log2b - LOG2VEC;
        return Walk<P>{t + offset(v), v & ((1 << log2vpb) - 1), lanes, log2vpb, (1 << (2 * log2b)) - (1 << log2b)};
    }
};

template <int LOG2VEC>
__device__ __forceinline__ BsStagedRow<LOG2VEC> bs_staged_row(const int* offsets, const int* causal_prefix, i64 rid,
                                                              i64 nnz, i64 groups, int log2b, bool causal) {
    i64 z, hr;
    divmod(rid >> log2b, groups, z, hr);
    const int i = (int)(rid & ((1 << log2b) - 1));
    const int o0 = offsets[hr];
    const int length = (offsets[hr + 1] - o0) << log2b;
    BsStagedRow<LOG2VEC> row;
    row.base = ((z * nnz + o0) << (2 * log2b)) + ((i64)i << log2b);
    row.log2b = log2b;
    row.vectors = length >> LOG2VEC;
    row.kept = length;
    if (causal) {
        const int c = causal_prefix[hr];
        row.kept = min(length, ((c >> 1) << log2b) + (c & 1) * (i + 1));
    }
    return row;
}

// Starts copying the row's vectors first .. first + count - 1 of `src` into buf (this lane's: lane, lane + lanes,
// ...); cp_async_wait_all() waits for them.
template <typename T, int LOG2VEC>
__device__ __forceinline__ void bs_stage(uint4* buf, const T* src, const BsStagedRow<LOG2VEC>& row, int first,
                                         int count, int lane, int lanes) {
    auto at = row.walk(src, first + lane, lanes);
    for (int v = lane; v < count; v += lanes, at.next()) cp_async16(buf + v, at.p);
}

// The largest score (scale * x) among a staged vector's elements 0 .. valid - 1, as the raw word(s) that hold
// it: the elements' bits are xor-ed with `flip` (their sign bits when scale < 0, so that the largest is the
// smallest x, negated) and masked ones set to -inf; 16-bit pairs are compared as they are (max_pairs, NaN kept).
template <typename T>
__device__ __forceinline__ u32 bs_max_word(const uint4& q, u32 flip, int valid) {
    constexpr int VEC = BsVec<T>::VEC;
    constexpr int PER_WORD = Elem<T>::PER_WORD;
    u32 w[4] = {q.x ^ flip, q.y ^ flip, q.z ^ flip, q.w ^ flip};
    if (valid < VEC) {
        const u32 none = Elem<T>::bits(-MS_INF) & (PER_WORD == 1 ? ~0u : 0xffffu);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            if (e < valid) continue;
            u32& word = w[e / PER_WORD];
            if constexpr (PER_WORD == 1) word = none;
            else word = e % 2 ? (word & 0xffffu) | (none << 16) : (word & 0xffff0000u) | none;
        }
    }
    if constexpr (PER_WORD == 1) {
        return __float_as_uint(fmaxf(fmaxf(__uint_as_float(w[0]), __uint_as_float(w[1])),
                                     fmaxf(__uint_as_float(w[2]), __uint_as_float(w[3]))));
    } else {
        return max_pairs<T>(max_pairs<T>(w[0], w[1]), max_pairs<T>(w[2], w[3]));
    }
}

// VEC floats as one 16-byte vector of T.
template <typename T>
__device__ __forceinline__ uint4 bs_pack(const float (&f)[BsVec<T>::VEC]) {
    if constexpr (Elem<T>::PER_WORD == 1) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    } else {
        return make_uint4(pack_pair<T>(f[0], f[1]), pack_pair<T>(f[2], f[3]), pack_pair<T>(f[4], f[5]),
                          pack_pair<T>(f[6], f[7]));
    }
}

// 2^(c * x - t) of a staged vector's elements, times inv; PARTIAL (the row's vector that its kept prefix ends in):
// 0 from element `valid` on (after the product: in a row that is NaN, inv is NaN).
template <typename T, bool PARTIAL>
__device__ __forceinline__ void bs_terms(const uint4& q, float c, float t, int valid, float (&f)[BsVec<T>::VEC],
                                         float inv = 1.f) {
    constexpr int VEC = BsVec<T>::VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = exp2_approx(fmaf(BsVec<T>::get(q, e), c, -t)) * inv;
    if constexpr (PARTIAL) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f[e] = e < valid ? f[e] : 0.f;
    }
}

// acc plus the sum of bs_terms.
template <typename T, bool PARTIAL>
__device__ __forceinline__ float bs_terms_sum(float acc, const uint4& q, float c, float t, int valid) {
    constexpr int VEC = BsVec<T>::VEC;
    float f[VEC];
    bs_terms<T, PARTIAL>(q, c, t, valid, f);
#pragma unroll
    for (int step = 1; step < VEC; step *= 2)  // a tree: log2(VEC) dependent adds, not VEC
#pragma unroll
        for (int e = 0; e < VEC; e += 2 * step) f[e] += f[e + step];
    return acc + f[0];
}

// bs_terms times inv, written to p as T.
template <typename T, bool PARTIAL>
__device__ __forceinline__ void bs_put(T* p, const uint4& q, float c, float t, float inv, int valid) {
    float f[BsVec<T>::VEC];
    bs_terms<T, PARTIAL>(q, c, t, valid, f, inv);
    *reinterpret_cast<uint4*>(p) = bs_pack<T>(f);
}

// The larger of the raw word(s) `top` and bs_max_word.
template <typename T>
__device__ __forceinline__ u32 bs_top(u32 top, const uint4& q, u32 flip, int valid) {
    const u32 w = bs_max_word<T>(q, flip, valid);
    if constexpr (Elem<T>::PER_WORD == 1) return __float_as_uint(fmaxf(__uint_as_float(top), __uint_as_float(w)));
    else return max_pairs<T>(top, w);
}

// out = softmax(scale * x) of each row; dynamic shared memory: WARPS x 32 / lanes row buffers, row_stride 16-byte
// vectors apart (CAP, padded where fewer than 8 lanes a row would read the same banks). With c = scale * log2(e)
// and t = c * x* (x* the element of the largest score), exp(scale * x - scale * x*) = 2^(c * x - t) takes one FMA
// and ex2 per element; t's rounding is common to every term of a row and cancels in the quotient. A row staged in
// parts keeps its sum s for the t so far and rescales it by 2^(t_old - t_new) with the same rounded t. The rows of a
// warp run their parts together (the reductions take every lane). 2^LOG2LANES lanes a row, known at compile time
// so that its loops and reductions take constant strides (docs/tuning.md).
template <typename T, int WARPS, int CAP, int LOG2LANES>
MS_ROW_KERNEL(32 * WARPS) bs_fwd_staged(const T* x, T* out, const int* offsets, const int* causal_prefix, i64 Z,
                                        i64 nnz, i64 groups, int log2b, float scale, int causal, int row_stride) {
    using V = BsVec<T>;
    constexpr int VEC = V::VEC;
    extern __shared__ uint4 stage[];
    const int log2lanes = LOG2LANES;
    const int lanes = 1 << log2lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const int block_rows = WARPS << (5 - log2lanes);  // rows a block works on at once
    const int slot = threadIdx.x >> log2lanes;          // this lane's row among them
    uint4* buf = stage + slot * row_stride;
    const i64 total_rows = (Z * groups) << log2b;
    const float c = scale * 1.4426950408889634f;
    const u32 flip = scale < 0.f ? (Elem<T>::PER_WORD == 1 ? 0x80000000u : 0x80008000u) : 0u;
    const float magnitude = fabsf(c);
    // A warp's rows are consecutive, within one block-row (32 / lanes divides B): all or none of them exist.
    for (i64 rid = (i64)blockIdx.x * block_rows + slot; rid < total_rows; rid += (i64)gridDim.x * block_rows) {
        const auto row = bs_staged_row<V::LOG2VEC>(offsets, causal_prefix, rid, nnz, groups, log2b, causal != 0);
        const int loaded = (row.kept + VEC - 1) >> V::LOG2VEC;  // vectors holding a kept element
        const int warp_loaded = groups_max(loaded, lanes);
        const int whole = row.kept >> V::LOG2VEC;  // vectors whose elements are all kept; at most one more is loaded
        // Each pass below takes a lane's whole vectors of the part in a loop, then the partial one if it is the
        // lane's (v ends there: the part's vectors from `full` on are that one at most), so that the loops test no
        // element against the kept prefix.
        float t = -MS_INF, s = 0.f;
        for (int first = 0; first < warp_loaded; first += CAP) {
            const int count = max(0, min(CAP, loaded - first));
            const int full = max(0, min(count, whole - first));
            bs_stage(buf, x, row, first, count, lane, lanes);
            cp_async_wait_all();
            u32 top = V::splat(-MS_INF).x;
            int v = lane;
#pragma unroll 1
            for (; v < full; v += lanes) top = bs_top<T>(top, buf[v], flip, VEC);
            if (v < count) top = bs_top<T>(top, buf[v], flip, row.kept - (first + v) * VEC);
            // the part's largest score times log2(e): |c| * (the largest flipped x)
            const float top_x = Elem<T>::PER_WORD == 1 ? __uint_as_float(top)
                                                       : fmaxf(Elem<T>::get(top, 0), Elem<T>::get(top, 1));
            const float t_new = fmaxf(t, group_max(top_x * magnitude, lanes));
            // A score above -inf so far: the shift; else 0, so that the terms are 0 (NaN where fmaxf passed a NaN
            // over, which makes the row NaN).
            const bool any = t_new != -MS_INF;
            const float shift = any ? t_new : 0.f;
            float acc = 0.f;
            v = lane;
#pragma unroll 1
            for (; v < full; v += lanes) acc = bs_terms_sum<T, false>(acc, buf[v], c, shift, VEC);
            if (v < count) acc = bs_terms_sum<T, true>(acc, buf[v], c, shift, row.kept - (first + v) * VEC);
            acc = group_sum(acc, lanes);
            if (any) {
                s = s * exp2_approx(t - t_new) + acc;
                t = t_new;
            } else {
                s += acc;
            }
        }
        int zeros_from = loaded;
        if (row.kept == 0) {
            zeros_from = 0;  // nothing unmasked
        } else {
            // 1 / s unguarded: a NaN or +inf score makes s NaN, and every score -inf (t = -inf, the terms taken
            // with t = 0) makes it 0: NaN throughout, as dense softmax
            if (t == -MS_INF) t = 0.f;
            const float inv = 1.f / s;
            for (int first = 0; first < loaded; first += CAP) {
                const int count = min(CAP, loaded - first);
                if (loaded > CAP) {
                    bs_stage(buf, x, row, first, count, lane, lanes);
                    cp_async_wait_all();
                }
                const int full = max(0, min(count, whole - first));
                auto at = row.walk(out, first + lane, lanes);
                int v = lane;
#pragma unroll 2
                for (; v < full; v += lanes, at.next()) bs_put<T, false>(at.p, buf[v], c, t, inv, VEC);
                if (v < count) bs_put<T, true>(at.p, buf[v], c, t, inv, row.kept - (first + v) * VEC);
            }
        }
        auto at = row.walk(out, zeros_from + lane, lanes);
        for (int v = zeros_from + lane; v < row.vectors; v += lanes, at.next())
            *reinterpret_cast<uint4*>(at.p) = make_uint4(0u, 0u, 0u, 0u);
    }
}
