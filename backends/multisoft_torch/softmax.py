"""Row softmax and log_softmax in PyTorch's own ops.

On CUDA devices torch's own softmax kernels run, writing into the outputs:
they reduce each row in a tree, in float32 for 16-bit inputs. Elsewhere those
kernels are not accurate enough (on the CPU they add a row's exponentials in
order, which over a million float32 elements is off by several times the
tolerance, and a float16 log_softmax of a long row overflows its sum), so rows
are taken a chunk at a time, in float32 for 16-bit inputs: softmax is torch's
softmax divided by its row sums added in a tree (which corrects the kernel's
inexact sum), log_softmax is computed from torch's reductions (a max, and a sum
of exponentials added in a tree).
"""

import torch

from . import _chunks


def _own_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def forward(x: torch.Tensor, out: torch.Tensor, log: bool) -> None:
    if _own_kernels(x):
        (torch.log_softmax if log else torch.softmax)(x, -1, out=out)
        return
    compute = _compute_dtype(x.dtype)
    for rows in _chunks.slices(*x.shape, x.device):
        x_rows = x[rows].to(compute)
        result = out[rows] if out.dtype == compute else torch.empty_like(x_rows)
        if log:
            torch.sub(x_rows, x_rows.amax(-1, keepdim=True), out=result)
            result.sub_(result.exp().sum(-1, keepdim=True).log_())
        else:
            torch.softmax(x_rows, -1, out=result)
            result.div_(result.sum(-1, keepdim=True))
        if out.dtype != compute:
            out[rows] = result


def backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, log: bool) -> None:
    if _own_kernels(y):
        if log:
            torch.ops.aten._log_softmax_backward_data.out(dy, y, -1, y.dtype, out=dx)
        else:
            torch.ops.aten._softmax_backward_data.out(dy, y, -1, y.dtype, grad_input=dx)
        return
    compute = _compute_dtype(y.dtype)
    for rows in _chunks.slices(*y.shape, y.device):
        y_rows, dy_rows = y[rows].to(compute), dy[rows].to(compute)
        result = dx[rows] if dx.dtype == compute else torch.empty_like(y_rows)
        if log:  # dy - exp(y) * sum(dy)
            torch.exp(y_rows, out=result)
            result.mul_(-dy_rows.sum(-1, keepdim=True)).add_(dy_rows)
        else:  # y * (dy - sum(y * dy))
            torch.sub(dy_rows, (y_rows * dy_rows).sum(-1, keepdim=True), out=result)
            result.mul_(y_rows)
        if dx.dtype != compute:
            dx[rows] = result
