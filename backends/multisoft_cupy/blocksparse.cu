// Block-sparse softmax over the compressed blocks (Z, nnz, B, B).
// Row i of block-row hr (= h * Mb + r) is the concatenation of row i of the
// blocks offsets[hr] .. offsets[hr + 1]; logical column c of it lies in block
// offsets[hr] + c / B at column c % B (absolute column columns[...] * B + c % B).
// One row group (TPR threads) per row; rows are numbered (z, hr, i).
#include "common.cuh"

struct BlockMap {
    int log2b;
    i64 bb;
    __device__ __forceinline__ i64 operator()(i64 c) const { return (c >> log2b) * bb + (c & ((1 << log2b) - 1)); }
};

struct BlockRow {
    i64 base;     // element offset of row i of the block-row's first block
    i64 n;        // logical columns
    i64 first;    // index of the first block
    i64 abs_row;  // absolute row r * B + i
};

__device__ __forceinline__ BlockRow block_row(const int* offsets, i64 rid, i64 nnz, i64 groups, int block_rows,
                                              int log2b) {
    const i64 b = (i64)1 << log2b;
    const i64 i = rid & (b - 1);
    const i64 hr = (rid >> log2b) % groups;
    const i64 z = (rid >> log2b) / groups;
    const i64 o0 = offsets[hr], o1 = offsets[hr + 1];
    BlockRow r;
    r.base = ((z * nnz + o0) << (2 * log2b)) + i * b;
    r.n = (o1 - o0) << log2b;
    r.first = o0;
    r.abs_row = (hr % block_rows) * b + i;
    return r;
}

template <typename T, int TPR, int ROWS, int VPT>
MS_ROW_KERNEL(TPR * ROWS) bs_fwd(const T* x, T* out, const int* offsets, const int* columns, i64 Z, i64 nnz,
                                 i64 groups, int block_rows, int log2b, float scale, int causal, int vec_ok) {
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const bool vec = vec_ok != 0;
    const BlockMap map{log2b, (i64)1 << (2 * log2b)};
    const i64 total_rows = (Z * groups) << log2b;
    const i64 col_mask = ((i64)1 << log2b) - 1;
        typename TL::Regs v;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / TPR; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BlockRow br = block_row(offsets, rid, nnz, groups, block_rows, log2b);
        const i64 ntiles = (br.n + TL::SIZE - 1) / TL::SIZE;
        // scale * x, or -inf where masked (causal, or past the row's end)
        auto value = [&](int e, i64 start) {
            const i64 c = TL::col(start, lane, e, vec);
            if (c >= br.n) return -MS_INF;
            if (causal && (i64)columns[br.first + (c >> log2b)] * ((i64)1 << log2b) + (c & col_mask) > br.abs_row)
                return -MS_INF;
            return TL::get(v, e) * scale;
        };
        Stats st = stats_empty();
        i64 last = -1;
        for (i64 t = 0; t < ntiles; ++t) {
            const i64 start = t * TL::SIZE;
            TL::load(v, x + br.base, map, start, br.n, lane, vec, 0.f);
            float tile_max = -MS_INF;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) tile_max = fmaxf(tile_max, value(e, start));
            st = stats_shift(st, tile_max);
            if (st.m != -MS_INF) {
                float acc = 0.f;
#pragma unroll
                for (int e = 0; e < TL::EPT; ++e) acc += exp_diff(value(e, start), st.m);
                st.s += acc;
            }
            last = t;
        }
        st = row_reduce<TPR, 1>(st);
        const bool empty = st.m == -MS_INF;  // every element masked (or -inf): zeros
        const float inv_sum = 1.f / st.s;
        for (i64 t = last; t >= 0; --t) {
            const i64 start = t * TL::SIZE;
            if (t != last) TL::load(v, x + br.base, map, start, br.n, lane, vec, 0.f);
            float y[TL::EPT];
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) y[e] = empty ? 0.f : exp_diff(value(e, start), st.m) * inv_sum;
            TL::set_all(v, y);
            TL::store(v, out + br.base, map, start, br.n, lane, vec);
        }
    }
}

// dx = scale * y * (dy - sum_row(y * dy))
template <typename T, int TPR, int ROWS, int VPT>
MS_ROW_KERNEL(TPR * ROWS) bs_bwd(const T* y, const T* dy, T* dx, const int* offsets, i64 Z, i64 nnz, i64 groups,
                                 int block_rows, int log2b, float scale, int vec_ok) {
    using TL = Tile<T, TPR, VPT>;
    const int lane = threadIdx.x % TPR;
    const bool vec = vec_ok != 0;
    const BlockMap map{log2b, (i64)1 << (2 * log2b)};
    const i64 total_rows = (Z * groups) << log2b;
        typename TL::Regs vy, vd;
    for (i64 rid = (i64)blockIdx.x * ROWS + threadIdx.x / TPR; rid < total_rows; rid += (i64)gridDim.x * ROWS) {
        const BlockRow br = block_row(offsets, rid, nnz, groups, block_rows, log2b);
        const i64 ntiles = (br.n + TL::SIZE - 1) / TL::SIZE;
        Stats st = stats_empty();
        i64 last = -1;
        for (i64 t = 0; t < ntiles; ++t) {
            TL::load(vy, y + br.base, map, t * TL::SIZE, br.n, lane, vec, 0.f);
            TL::load(vd, dy + br.base, map, t * TL::SIZE, br.n, lane, vec, 0.f);
            float acc = 0.f;
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) acc += TL::get(vy, e) * TL::get(vd, e);
            st.a += acc;
            last = t;
        }
        const float dot = row_reduce<TPR, 1>(st).a;
        for (i64 t = last; t >= 0; --t) {
            if (t != last) {
                TL::load(vy, y + br.base, map, t * TL::SIZE, br.n, lane, vec, 0.f);
                TL::load(vd, dy + br.base, map, t * TL::SIZE, br.n, lane, vec, 0.f);
            }
            float out[TL::EPT];
#pragma unroll
            for (int e = 0; e < TL::EPT; ++e) out[e] = scale * TL::get(vy, e) * (TL::get(vd, e) - dot);
            TL::set_all(vd, out);
            TL::store(vd, dx + br.base, map, t * TL::SIZE, br.n, lane, vec);
        }
    }
}
