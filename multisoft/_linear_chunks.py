"""The chunk loop that the fused-linear ops share: ``F.linear(input, linear_weight, linear_bias)`` a chunk of rows
at a time through one logits buffer, a per-chunk step on each chunk's logits (the op's kernels, leaving their
gradient in the buffer where one is wanted), and the gradients of input, linear_weight and linear_bias accumulated
from it by torch's matmuls; with the default chunk, the checks of the linear layer's arguments, and what
``F.linear`` does under ``torch.autocast``.
"""

from __future__ import annotations

import torch

from . import _validate
from ._loss_rules import is_dtensor

# A chunk's logits take at most CHUNK_BYTES (or an eighth of all the logits, if less), but a chunk has at least
# MIN_CHUNK_ROWS rows (all of them where there are fewer): matmuls of that height still run near the GPU's peak.
CHUNK_BYTES = 256 << 20
MIN_CHUNK_ROWS = 1024


def default_chunk_rows(rows: int, classes: int, element_size: int) -> int:
    """Rows per chunk: the fewer of an eighth of the rows and the rows whose logits fit in CHUNK_BYTES, but at
    least MIN_CHUNK_ROWS (all the rows where there are fewer)."""
    budget = max(CHUNK_BYTES // max(classes * element_size, 1), 1)
    eighth = -(-rows // 8)
    return max(1, min(rows, max(MIN_CHUNK_ROWS, min(eighth, budget))))


def chunk_pass(input2d, linear_weight, linear_bias, chunk_rows, step, want=(False, False, False)):
    """One pass over the rows, a chunk at a time, through one logits buffer: ``step(logits, rows)`` computes the
    chunk's loss and leaves in the logits their gradient where ``want`` asks for any of (grad_input,
    grad_weight, grad_bias), which are accumulated from it and returned (each None unless asked for)."""
    rows, classes = input2d.shape[0], linear_weight.shape[0]
    chunk_rows = min(chunk_rows, rows)
    buffer = torch.empty((chunk_rows, classes), dtype=input2d.dtype, device=input2d.device)
    want_input, want_weight, want_bias = want
    grad_input = torch.empty_like(input2d, memory_format=torch.contiguous_format) if want_input else None
    weight_sum = bias_sum = None
    accumulate_dtype = torch.promote_types(input2d.dtype, torch.float32)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        x, logits = input2d[start:stop], buffer[: stop - start]
        if linear_bias is None:
            torch.mm(x, linear_weight.t(), out=logits)
        else:
            torch.addmm(linear_bias, x, linear_weight.t(), out=logits)
        step(logits, slice(start, stop))
        if want_input:
            torch.mm(logits, linear_weight, out=grad_input[start:stop])
        if want_weight:
            if weight_sum is None:
                weight_sum = torch.mm(logits.t(), x)
            elif weight_sum.dtype == x.dtype:
                weight_sum.addmm_(logits.t(), x)
            else:
                weight_sum.add_(torch.mm(logits.t(), x))
        if want_bias:
            part = logits.sum(0, dtype=accumulate_dtype)
            bias_sum = part if bias_sum is None else bias_sum.add_(part)
    if grad_input is not None:
        grad_input = step.input_gradient(grad_input)
    grad_weight = weight_sum.to(linear_weight.dtype) if weight_sum is not None else None
    grad_bias = bias_sum.to(linear_bias.dtype) if bias_sum is not None else None
    return grad_input, grad_weight, grad_bias


def autocast_linear(input, linear_weight, linear_bias):
    """What ``F.linear`` does under ``torch.autocast``: its floating arguments (but float64 ones) on the autocast's
    device type are cast to the autocast's dtype, so that 16-bit hidden states meet a float32 output layer in
    16 bits, and the float32 weight gets its gradient in float32 through the cast. Unchanged outside autocast
    (where the dtypes must match, as ``F.linear``'s do)."""
    if not isinstance(input, torch.Tensor) or not torch.is_autocast_enabled(input.device.type):
        return input, linear_weight, linear_bias
    device_type, dtype = input.device.type, torch.get_autocast_dtype(input.device.type)

    def cast(tensor):
        if (isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64
                and tensor.device.type == device_type):
            return tensor.to(dtype)
        return tensor

    return cast(input), cast(linear_weight), cast(linear_bias)


def check_linear_layer(op: str, input, linear_weight, linear_bias, chunk_size, **others) -> int:
    """Checks ``input`` (M, H) or (B, T, H), ``linear_weight`` (V, H) and ``linear_bias`` (V,) or None, of one
    floating dtype and on one device with ``others`` (named tensors or None), and ``chunk_size`` (None or >= 1);
    none a DTensor. Returns V, this rank's rows of the output layer."""
    tensors = dict(input=input, linear_weight=linear_weight, linear_bias=linear_bias, **others)
    for name, tensor in tensors.items():
        if is_dtensor(tensor):
            raise TypeError(f"{name} is a DTensor: {op} takes plain tensors (with process_group, this rank's local "
                            f"rows of the output layer, e.g. linear_weight.to_local())")
    _validate.floating(input, "input")
    _validate.floating(linear_weight, "linear_weight")
    if linear_bias is not None:
        _validate.floating(linear_bias, "linear_bias")
    if input.ndim not in (2, 3):
        raise ValueError(f"input must have shape (M, H) or (B, T, H), got {tuple(input.shape)}")
    hidden = input.shape[-1]
    if linear_weight.ndim != 2 or linear_weight.shape[1] != hidden:
        raise ValueError(f"linear_weight must have shape (V, {hidden}) for input of shape {tuple(input.shape)}, "
                         f"got {tuple(linear_weight.shape)}")
    classes = linear_weight.shape[0]
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight must have the input's dtype {input.dtype}, got {linear_weight.dtype}")
    if linear_bias is not None:
        if linear_bias.shape != (classes,):
            raise ValueError(f"linear_bias must have shape ({classes},), one per row of linear_weight, got "
                             f"{tuple(linear_bias.shape)}")
        if linear_bias.dtype != input.dtype:
            raise TypeError(f"linear_bias must have the input's dtype {input.dtype}, got {linear_bias.dtype}")
    _validate.same_device(input, "input", **{name: t for name, t in tensors.items() if name != "input"})
    if chunk_size is not None and _validate.integer(chunk_size, "chunk_size") < 1:
        raise ValueError(f"chunk_size must be a number of rows >= 1, or None for the default; got {chunk_size}")
    return classes
