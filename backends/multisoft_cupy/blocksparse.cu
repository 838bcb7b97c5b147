// Block-sparse softmax over the compressed blocks (Z, nnz, B, B).
// Row i of block-row hr (= h * Mb + r) is the concatenation of row i of the
// blocks offsets[hr] .. offsets[hr + 1]. One row group (TPR threads) per row;
// rows are numbered (z, hr, i). The row is read as VEC-element vectors (16
// bytes), each inside one block: vector v lies in block v / VPB (VPB = B / VEC
// vectors per block row) at column (v % VPB) * VEC. Lane `lane` owns vectors
// t * TPR * VPT + k * TPR + lane of tile t. A row of one tile is read once and
// written from registers; a longer row reads its tiles again (last one excepted).
#include "common.cuh"

template <typename T>
struct BsVec {
    static constexpr int VEC = 16 / (int)sizeof(T);
    static constexpr int LOG2VEC = VEC == 4 ? 2 : 3;

    // VEC elements at p as floats: one 16-byte load when aligned, else element by element.
    __device__ static __forceinline__ void load(const T* p, bool vec, float (&f)[VEC]) {
        if (vec) {
            const uint4 q = *reinterpret_cast<const uint4*>(p);
            const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[e] = Elem<T>::get(w[e / Elem<T>::PER_WORD], e % Elem<T>::PER_WORD);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) f[e] = to_float(p[e]);
        }
    }

    __device__ static __forceinline__ void store(T* p, bool vec, const float (&f)[VEC]) {
        if (vec) {
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (Elem<T>::PER_WORD == 1) w[i] = Elem<T>::bits(f[i]);
                else w[i] = (Elem<T>::bits(f[2 * i]) & 0xffffu) | (Elem<T>::bits(f[2 * i + 1]) << 16);
            }
            *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) p[e] = from_float<T>(f[e]);
        }
    }
};

// One row of a block-row: where its vectors are and how many.
struct BsRow {
    i64 first;    // offsets[hr]: the block-row's first block (columns[] index)
    i64 nvec;     // vectors in the row
    i64 base;     // element offset of row i of the first block
    int abs_row;  // r * B + i
    int log2b;
    int log2vpb;  // log2(B / VEC)

    __device__ __forceinline__ i64 block_of(i64 v) const { return v >> log2vpb; }
    __device__ __forceinline__ int col_of(i64 v, int log2vec) const {
        return (int)(v & ((1 << log2vpb) - 1)) << log2vec;
    }
    __device__ __forceinline__ i64 offset(i64 v, int log2vec) const {
        return base + (block_of(v) << (2 * log2b)) + col_of(v, log2vec);
    }
};

template <int LOG2VEC>
__device__ __forceinline__ BsRow bs_row(const int* offsets, i64 rid, i64 nnz, i64 groups, int block_rows,
                                        int log2b) {
    const i64 i = rid & (((i64)1 << log2b) - 1);
    const i64 hr = (rid >> log2b) % groups;
    const i64 z = (rid >> log2b) / groups;
    const i64 o0 = offsets[hr], o1 = offsets[hr + 1];
    BsRow r;
    r.first = o0;
    r.log2b = log2b;
    r.log2vpb = log2b - LOG2VEC;
    r.nvec = (o1 - o0) << r.log2vpb;
    r.base = ((z * nnz + o0) << (2 * log2b)) + (i << log2b);
    r.abs_row = (int)((hr % block_rows) << log2b) + (int)i;
    return r;
}

template <typename T, int TPR, int ROWS, int VPT>
MS_ROW_KERNEL(TPR * ROWS) bs_fwd(const T* x, T* out, const int* offsets, const int* columns, i64 Z, i64 nnz,
                                 i64 groups, int block_rows, int log2b, float scale, int causal, int vec_ok) {
    using V = BsVec<T>;
    constexpr int VEC = V::VEC;
    constexpr i64 TILE = (i64)TPR * VPT;  // vectors per tile
    const int lane = threadIdx.x % TPR;
    const bool vec = vec_ok != 0;
    const i64 total_rows = (Z * groups) << log2b;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / TPR; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BsRow row = bs_row<V::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b);
        const i64 ntiles = (row.nvec + TILE - 1) / TILE;
        float v[VPT][VEC];
        // scale * x, or -inf where masked (causal, or past the row's end)
        auto scores = [&](i64 t) {
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const i64 index = t * TILE + k * TPR + lane;
                int keep = -1;  // elements 0 .. keep of the vector are unmasked
                if (index < row.nvec) {
                    V::load(x + row.offset(index, V::LOG2VEC), vec, v[k]);
                    keep = VEC - 1;
                    if (causal) {
                        const i64 col = ((i64)columns[row.first + row.block_of(index)] << log2b) +
                                        row.col_of(index, V::LOG2VEC);
                        keep = (int)max((i64)-1, min((i64)(VEC - 1), (i64)row.abs_row - col));
                    }
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[k][e] = e <= keep ? v[k][e] * scale : -MS_INF;
            }
        };
        // Pass 1: running max and sum; v ends as exp(score - st.m) of the last tile.
        Stats st = stats_empty();
        for (i64 t = 0; t < ntiles; ++t) {
            scores(t);
            float tile_max = -MS_INF;
#pragma unroll
            for (int k = 0; k < VPT; ++k)
#pragma unroll
                for (int e = 0; e < VEC; ++e) tile_max = fmaxf(tile_max, v[k][e]);
            st = stats_shift(st, tile_max);
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < VPT; ++k)
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    v[k][e] = st.m == -MS_INF ? 0.f : exp_diff(v[k][e], st.m);
                    acc += v[k][e];
                }
            st.s += acc;
        }
        const Stats all = row_reduce<TPR, 1>(st);
        const bool empty = all.m == -MS_INF;  // every element masked (or -inf): zeros
        const float inv_sum = empty ? 0.f : 1.f / all.s;
        const float last_factor = empty || st.m == -MS_INF ? 0.f : exp_diff(st.m, all.m) * inv_sum;
        // Pass 2: the last tile from registers, the others read again.
        for (i64 t = ntiles - 1; t >= 0; --t) {
            if (t != ntiles - 1) scores(t);
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const i64 index = t * TILE + k * TPR + lane;
                if (index >= row.nvec) continue;
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    v[k][e] = t == ntiles - 1 ? v[k][e] * last_factor
                                              : (empty ? 0.f : exp_diff(v[k][e], all.m) * inv_sum);
                V::store(out + row.offset(index, V::LOG2VEC), vec, v[k]);
            }
        }
    }
}

// dx = scale * y * (dy - sum_row(y * dy))
template <typename T, int TPR, int ROWS, int VPT>
MS_ROW_KERNEL(TPR * ROWS) bs_bwd(const T* y, const T* dy, T* dx, const int* offsets, i64 Z, i64 nnz, i64 groups,
                                 int block_rows, int log2b, float scale, int vec_ok) {
    using V = BsVec<T>;
    constexpr int VEC = V::VEC;
    constexpr i64 TILE = (i64)TPR * VPT;
    const int lane = threadIdx.x % TPR;
    const bool vec = vec_ok != 0;
    const i64 total_rows = (Z * groups) << log2b;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / TPR; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BsRow row = bs_row<V::LOG2VEC>(offsets, rid, nnz, groups, block_rows, log2b);
        const i64 ntiles = (row.nvec + TILE - 1) / TILE;
        float vy[VPT][VEC], vd[VPT][VEC];
        auto load = [&](i64 t) {
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const i64 index = t * TILE + k * TPR + lane;
                if (index < row.nvec) {
                    V::load(y + row.offset(index, V::LOG2VEC), vec, vy[k]);
                    V::load(dy + row.offset(index, V::LOG2VEC), vec, vd[k]);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) vy[k][e] = vd[k][e] = 0.f;
                }
            }
        };
        Stats st = stats_empty();
        for (i64 t = 0; t < ntiles; ++t) {
            load(t);
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < VPT; ++k)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc += vy[k][e] * vd[k][e];
            st.a += acc;
        }
        const float dot = row_reduce<TPR, 1>(st).a;
        for (i64 t = ntiles - 1; t >= 0; --t) {
            if (t != ntiles - 1) load(t);
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                const i64 index = t * TILE + k * TPR + lane;
                if (index >= row.nvec) continue;
#pragma unroll
                for (int e = 0; e < VEC; ++e) vd[k][e] = scale * vy[k][e] * (vd[k][e] - dot);
                V::store(dx + row.offset(index, V::LOG2VEC), vec, vd[k]);
            }
        }
    }
}
