"""Block-sparse softmax in PyTorch, float64 arithmetic, on the compressed blocks (scatter reductions per block-row).

Non-finite values follow the contract of ``backends/README.md``: a row's
unmasked elements get what dense ``torch.softmax`` gives over them (NaN for a
NaN or +inf among them, or when all are -inf), masked elements 0, a row with no
unmasked element zeros; the backward is 0 wherever the output is 0.
"""

import torch


def _row_reduce(values, rows, groups, reduce):
    """Reduce (Z, nnz, B) per-block row values over the blocks of each block-row -> (Z, groups, B)."""
    z, _, block = values.shape
    index = rows.view(1, -1, 1).expand_as(values)
    init = values.new_full((z, groups, block), float("-inf") if reduce == "amax" else 0.0)
    return init.scatter_reduce(1, index, values, reduce, include_self=True)


def _causal_mask(lut, device):
    """(nnz, B, B) True where the absolute column exceeds the absolute row."""
    block = lut.block
    block_row = lut.rows.long() % lut.block_rows
    i = torch.arange(block, device=device)
    row = block_row.view(-1, 1, 1) * block + i.view(1, -1, 1)
    col = lut.columns.long().view(-1, 1, 1) * block + i.view(1, 1, -1)
    return col > row


def forward(x, out, lut, scale: float, is_causal: bool) -> None:
    groups = lut.heads * lut.block_rows
    rows = lut.rows.long()
    s = x.to(torch.float64) * scale
    masked = _causal_mask(lut, x.device).unsqueeze(0) if is_causal else torch.zeros_like(s, dtype=torch.bool)
    row_max = _row_reduce(s.masked_fill(masked, float("-inf")).amax(-1), rows, groups, "amax")
    # Only a max of -inf is replaced (all unmasked -inf, or none): a +inf or NaN max must make the row NaN.
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    e = (s - shift[:, rows].unsqueeze(-1)).exp().masked_fill(masked, 0.0)
    row_sum = _row_reduce(e.sum(-1), rows, groups, "sum")
    out.copy_((e / row_sum[:, rows].unsqueeze(-1)).masked_fill(masked, 0.0))


def backward(y, dy, dx, lut, scale: float) -> None:
    groups = lut.heads * lut.block_rows
    rows = lut.rows.long()
    y, dy = y.to(torch.float64), dy.to(torch.float64)
    dot = _row_reduce((y * dy).sum(-1), rows, groups, "sum")
    dx.copy_(torch.where(y == 0, 0.0, scale * y * (dy - dot[:, rows].unsqueeze(-1))))
