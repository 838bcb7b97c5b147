"""Block-sparse softmax in PyTorch's own ops, on the compressed blocks (scatter reductions per block-row).

Arithmetic is float32 (float64 for float64 inputs). The blocks of all batch
entries are taken as one list and processed a chunk of blocks at a time, so the
temporaries stay bounded; the row statistics (a value per row of each
block-row) are gathered over all chunks before any output is written. Without
host synchronisation.

Non-finite values follow the contract of ``backends/README.md``: a row's
unmasked elements get what dense ``torch.softmax`` gives over them (NaN for a
NaN or +inf among them, or when all are -inf), masked elements 0, a row with no
unmasked element zeros; the backward is 0 wherever the output is 0.
"""

import torch

from . import _chunks


class _Blocks:
    """The (Z * nnz) blocks of a batch, in chunks, with each block's row of statistics and its causal mask."""

    def __init__(self, x, lut, is_causal: bool):
        batch, nnz, block, _ = x.shape
        self.block = block
        self.lut = lut
        self.nnz = nnz
        self.is_causal = is_causal
        self.compute = torch.promote_types(x.dtype, torch.float32)
        groups = lut.heads * lut.block_rows
        # statistics row of block k = z * nnz + n: z * groups + rows[n]
        self.stat_row = (torch.arange(batch, device=x.device).unsqueeze(1) * groups + lut.rows.long()).reshape(-1)
        self.stat_shape = (batch * groups, block)
        self.chunks = _chunks.slices(batch * nnz, block * block, x.device)
        column_minus_row = torch.arange(block, device=x.device)
        self.column_minus_row = column_minus_row.unsqueeze(0) - column_minus_row.unsqueeze(1)

    def flat(self, t):
        return t.view(-1, self.block, self.block)

    def index(self, chunk):
        """The statistics row of each row of the chunk's blocks, (k, B), for scatter and gather."""
        return self.stat_row[chunk].unsqueeze(1).expand(-1, self.block)

    def masked(self, chunk):
        """(k, B, B) True where the absolute column exceeds the absolute row (causal), or None."""
        if not self.is_causal:
            return None
        n = torch.arange(chunk.start, chunk.stop, device=self.stat_row.device) % self.nnz
        lut = self.lut
        block_offset = lut.columns[n].long() - lut.rows[n].long() % lut.block_rows
        return (block_offset * self.block).view(-1, 1, 1) + self.column_minus_row > 0


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    blocks = _Blocks(x, lut, is_causal)
    xs, outs = blocks.flat(x), blocks.flat(out)
    row_max = torch.full(blocks.stat_shape, float("-inf"), dtype=blocks.compute, device=x.device)
    row_sum = torch.zeros(blocks.stat_shape, dtype=blocks.compute, device=x.device)
    single = len(blocks.chunks) == 1  # then each pass hands its chunk to the next instead of recomputing it

    def scaled(chunk):
        return xs[chunk].to(blocks.compute, copy=True).mul_(scale), blocks.masked(chunk)

    def exponentials(s, masked, chunk):
        e = s.sub_(shift[blocks.stat_row[chunk]].unsqueeze(-1)).exp_()
        return e if masked is None else e.masked_fill_(masked, 0.0)

    for chunk in blocks.chunks:
        s, masked = scaled(chunk)
        kept = (s, masked) if single else None
        candidates = s if masked is None else s.masked_fill(masked, float("-inf"))
        row_max.scatter_reduce_(0, blocks.index(chunk), candidates.amax(-1), "amax", include_self=True)
    # Only a max of -inf is replaced (all unmasked -inf, or none): a +inf or NaN max must make the row NaN.
    shift = row_max.masked_fill_(row_max == float("-inf"), 0.0)
    for chunk in blocks.chunks:
        s, masked = kept if single else scaled(chunk)
        e = exponentials(s, masked, chunk)
        row_sum.scatter_add_(0, blocks.index(chunk), e.sum(-1))
    for chunk in blocks.chunks:
        if not single:  # else e and masked are the one chunk's, from the loop above
            s, masked = scaled(chunk)
            e = exponentials(s, masked, chunk)
        y = e.div_(row_sum[blocks.stat_row[chunk]].unsqueeze(-1))
        outs[chunk] = y if masked is None else y.masked_fill_(masked, 0.0)


def backward(y, dy, dx, lut, scale: float) -> None:
    blocks = _Blocks(y, lut, False)
    ys, dys, dxs = blocks.flat(y), blocks.flat(dy), blocks.flat(dx)
    dot = torch.zeros(blocks.stat_shape, dtype=blocks.compute, device=y.device)
    for chunk in blocks.chunks:
        products = ys[chunk].to(blocks.compute) * dys[chunk].to(blocks.compute)
        dot.scatter_add_(0, blocks.index(chunk), products.sum(-1))
    for chunk in blocks.chunks:
        y_chunk = ys[chunk].to(blocks.compute)
        grad = dys[chunk].to(blocks.compute) - dot[blocks.stat_row[chunk]].unsqueeze(-1)
        grad.mul_(y_chunk).mul_(scale)
        dxs[chunk] = grad.masked_fill_(y_chunk == 0, 0.0)
