"""Block-sparse softmax in PyTorch, on the compressed blocks (scatter reductions per block-row)."""

import torch


def _row_reduce(values, rows, groups, reduce):
    """Reduce (Z, nnz, B) per-block row values over the blocks of each block-row -> (Z, groups, B)."""
    z, _, block = values.shape
    index = rows.long().view(1, -1, 1).expand_as(values)
    init = values.new_full((z, groups, block), float("-inf") if reduce == "amax" else 0.0)
    return init.scatter_reduce(1, index, values, reduce, include_self=reduce != "amax")


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
    if is_causal:
        s = s.masked_fill(_causal_mask(lut, x.device), float("-inf"))
    row_max = _row_reduce(s.amax(-1), rows, groups, "amax")
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    e = (s - row_max[:, rows].unsqueeze(-1)).exp()
    row_sum = _row_reduce(e.sum(-1), rows, groups, "sum")
    y = e / row_sum[:, rows].unsqueeze(-1)
    out.copy_(torch.where(row_sum[:, rows].unsqueeze(-1) > 0, y, 0.0))


def backward(y, dy, dx, lut, scale: float) -> None:
    groups = lut.heads * lut.block_rows
    rows = lut.rows.long()
    y, dy = y.to(torch.float64), dy.to(torch.float64)
    dot = _row_reduce((y * dy).sum(-1), rows, groups, "sum")
    dx.copy_(scale * y * (dy - dot[:, rows].unsqueeze(-1)))
