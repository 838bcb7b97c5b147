"""softmax and log_softmax: torch.library ops, autograd, and the public functions."""

from __future__ import annotations

import warnings

import torch

from . import _validate
from ._forward_ad import has_tangent, refuse_transforms
from ._registry import get_backend, resolve_name

# -- the kernels of one backend on 2-D contiguous rows, into torch-allocated outputs


def _forward(x: torch.Tensor, log: bool, backend: str) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.numel():  # kernels never see an empty tensor (the torch.library ops come here too)
        get_backend(backend).kernels("softmax").forward(x, out, log)
    return out


def _backward(y: torch.Tensor, dy: torch.Tensor, log: bool, backend: str) -> torch.Tensor:
    dx = torch.empty_like(y)
    if y.numel():
        get_backend(backend).kernels("softmax").backward(y, dy.contiguous(), dx, log)
    return dx


# -- torch.library ops, used under torch.compile


@torch.library.custom_op("multisoft::softmax_forward", mutates_args=())
def softmax_forward_op(x: torch.Tensor, log: bool, backend: str) -> torch.Tensor:
    return _forward(x, log, backend)


@softmax_forward_op.register_fake
def _(x, log, backend):
    return torch.empty_like(x)


@torch.library.custom_op("multisoft::softmax_backward", mutates_args=())
def softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, log: bool, backend: str) -> torch.Tensor:
    return _backward(y, dy, log, backend)


@softmax_backward_op.register_fake
def _(y, dy, log, backend):
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    _, ctx.log, ctx.backend = inputs
    ctx.save_for_backward(output)


def _op_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_backward_op(y, dy, ctx.log, ctx.backend), None, None


softmax_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _backward_setup_context(ctx, inputs, output):
    y, dy, ctx.log, _ = inputs
    ctx.save_for_backward(y, dy)


def _backward_op_backward(ctx, grad_dx):
    """Double backward under torch.compile: the backward op's own gradient, in torch ops."""
    y, dy = ctx.saved_tensors
    grad_y, grad_dy = _backward_of_backward(y, dy, grad_dx, ctx.log)
    return grad_y, grad_dy, None, None


softmax_backward_op.register_autograd(_backward_op_backward, setup_context=_backward_setup_context)


# -- autograd Function, the eager path (no custom-op dispatch cost)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, backend, tangent=False):
        y = _forward(x, log, backend)
        ctx.log, ctx.backend = log, backend
        ctx.save_for_backward(y)
        if tangent:  # x only where forward-mode AD asks for it, so that a backward graph does not keep it
            ctx.save_for_forward(x)
        return y

    @staticmethod
    def jvp(ctx, x_tangent, *_):
        """Forward-mode AD: the tangent of y for the tangent of x, in torch ops from x (not from y, which for
        16-bit x is rounded: a log_softmax's exp(y) would be off by y's rounding)."""
        (x,) = ctx.saved_tensors
        return _tangent(x, x_tangent, ctx.log)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        # create_graph=True, or forward-mode AD over this backward: a gradient that can itself be differentiated
        if torch.is_grad_enabled() or has_tangent(y, dy):
            return _differentiable_backward(y, dy, ctx.log), None, None, None
        return _backward(y, dy, ctx.log, ctx.backend), None, None, None


def _differentiable_backward(y: torch.Tensor, dy: torch.Tensor, log: bool) -> torch.Tensor:
    """The backward in torch ops on the saved output (itself a function of x), for double backward."""
    compute = torch.promote_types(y.dtype, torch.float32)
    y32, dy32 = y.to(compute), dy.to(compute)
    if log:
        dx = dy32 - y32.exp() * dy32.sum(-1, keepdim=True)
    else:
        dx = y32 * (dy32 - (y32 * dy32).sum(-1, keepdim=True))
    return dx.to(y.dtype)


def _backward_of_backward(y, dy, g, log):
    """The gradients of sum(g * dx) in y and dy, dx the backward (``_differentiable_backward``): softmax
    ``dx = y * (dy - s)``, s = sum(y * dy): d/dy = y * (g - sum(g * y)), d/dy' = g * (dy - s) - dy * sum(g * y);
    log_softmax ``dx = dy - exp(y) * sum(dy)``: d/ddy = g - sum(g * exp(y)), d/dy = -g * exp(y) * sum(dy).
    In float32 (float64 for float64), returned in y's and dy's dtypes."""
    compute = torch.promote_types(y.dtype, torch.float32)
    y32, dy32, g32 = y.to(compute), dy.to(compute), g.to(compute)
    if log:
        p = y32.exp()
        grad_dy = g32 - (g32 * p).sum(-1, keepdim=True)
        grad_y = -g32 * p * dy32.sum(-1, keepdim=True)
    else:
        g_dot_y = (g32 * y32).sum(-1, keepdim=True)
        grad_dy = y32 * (g32 - g_dot_y)
        grad_y = g32 * (dy32 - (y32 * dy32).sum(-1, keepdim=True)) - dy32 * g_dot_y
    return grad_y.to(y.dtype), grad_dy.to(dy.dtype)


def _tangent(x: torch.Tensor, x_tangent: torch.Tensor, log: bool) -> torch.Tensor:
    """d y for d x = ``x_tangent`` = t, with p = softmax(x): softmax ``p * (t - sum(p * t))``, log_softmax
    ``t - sum(p * t)``; in float32 (float64 for float64) and returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    p, t = torch.softmax(x.to(compute), -1), x_tangent.to(compute)
    dot = (p * t).sum(-1, keepdim=True)
    return (t - dot if log else p * (t - dot)).to(x.dtype)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """float32 where torch's softmax and log_softmax would compute in it because of ``torch.autocast``: CUDA's
    autocast runs them in float32 for a floating input but float64 (16-bit in, float32 out) when no ``dtype=`` is
    given; the CPU's leaves them alone."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return None


def implicit_dim(name: str, ndim: int, stacklevel: int) -> int:
    """torch's choice of ``dim`` when none is given (``F.softmax(x)``), with its deprecation warning: 0 for 0-, 1-
    and 3-dimensional inputs, else 1."""
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X as "
                  f"an argument.", stacklevel=stacklevel)
    return 0 if ndim in (0, 1, 3) else 1


def _apply(x, dim, stacklevel, dtype, backend, log):
    """The public functions' work, ``x`` their ``input``; ``stacklevel`` their third argument: F.softmax's
    ``_stacklevel`` (the implicit dim's warning is attributed to that frame, counted from the public function as
    torch counts from its own), or torch.softmax's dtype."""
    op = "log_softmax" if log else "softmax"
    refuse_transforms(op)
    _validate.tensor(x, "input")
    if type(stacklevel) is not int:
        if isinstance(stacklevel, torch.dtype):  # torch.softmax(input, dim, dtype): a dtype third
            if dtype is not None:
                raise TypeError(f"{op} got two dtypes: {stacklevel} third (torch.softmax's place) and "
                                f"dtype={dtype}")
            dtype, stacklevel = stacklevel, 3
        else:
            stacklevel = _validate.integer(stacklevel, "_stacklevel")
    dtype = _validate.float_dtype(dtype)
    if dtype is None:
        _validate.floating(x, "input")  # like torch: an integer input needs a floating dtype= to compute in
        dtype = _autocast_dtype(x)
    if dim is None:
        dim = implicit_dim(op, x.ndim, stacklevel=stacklevel + 1)  # + 1: this function's frame
    dim = _validate.dim(dim, x.ndim)
    backend = _validate.backend_name(backend)
    if dtype is not None:
        x = x.to(dtype)
    if x.ndim == 0:
        return _apply(x.reshape(1), 0, 3, None, backend, log).reshape(())
    name = resolve_name(x.device, x.dtype, backend, "softmax")
    if x.numel() == 0:
        return (torch.log_softmax if log else torch.softmax)(x, dim)  # no elements: torch's, autograd and all
    last = dim == x.ndim - 1
    rows = x if last else x.movedim(dim, -1)
    rows_2d = rows if rows.ndim == 2 else rows.reshape(-1, rows.shape[-1])
    rows_2d = rows_2d.contiguous()
    if torch.compiler.is_compiling():
        y = softmax_forward_op(rows_2d, log, name)
    elif has_tangent(rows_2d):
        y = _Softmax.apply(rows_2d, log, name, True)
    elif rows_2d.requires_grad and torch.is_grad_enabled():
        y = _Softmax.apply(rows_2d, log, name)
    else:
        y = _forward(rows_2d, log, name)
    if rows.ndim != 2:
        y = y.view(rows.shape)
    return y if last else y.movedim(-1, dim)


def softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int | torch.dtype = 3,
            dtype: torch.dtype | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Softmax of ``input`` along ``dim``, like ``torch.nn.functional.softmax``; differentiable.

    The parameters before ``*`` are ``F.softmax``'s, by name and position, and
    a call to ``torch.softmax(input, dim, dtype)`` works too: the third may be
    F's ``_stacklevel`` (an int, the frame the implicit dim's warning names,
    counted as torch counts it) or a dtype. ``dim=None`` is torch's deprecated
    implicit choice, with its warning (dim 0 for 0-, 1- and 3-dimensional
    ``input``, else 1): pass ``dim``. ``dtype`` casts ``input`` first (so an
    integer ``input`` works with a floating ``dtype``, as in torch); without
    it, under CUDA's ``torch.autocast`` a 16-bit ``input`` gives a float32
    result, as torch's does. ``backend`` picks the implementation (see
    ``multisoft.use_backend``). Arithmetic is float32 for 16-bit inputs. Double
    backward (``create_graph=True``) and forward-mode AD
    (``torch.autograd.forward_ad``) work; inside a ``torch.func`` transform it
    raises ``NotImplementedError``.
    """
    return _apply(input, dim, _stacklevel, dtype, backend, log=False)


def log_softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int | torch.dtype = 3,
                dtype: torch.dtype | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Log-softmax of ``input`` along ``dim``, like ``torch.nn.functional.log_softmax``; arguments as
    ``softmax``."""
    return _apply(input, dim, _stacklevel, dtype, backend, log=True)
