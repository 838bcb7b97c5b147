"""Block-sparse softmax: the look-up table, torch.library ops, autograd, public functions.

The compressed format is the block-sparse attention libraries': ``layout`` is a
0/1 tensor (H, M/block, N/block) and ``x`` (Z, nnz, block, block) holds the
nonzero blocks in ``layout.nonzero()`` order (head, block-row, block-column).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._registry import get_backend, resolve_name

BLOCKS = (16, 32, 64, 128)


@dataclass(frozen=True)
class BlockSparseLUT:
    """Where each block-row's blocks are, built once per (layout, block, device).

    The blocks of block-row ``r`` of head ``h`` are ``x[:, offsets[h*Mb + r] :
    offsets[h*Mb + r + 1]]``, in ascending block-column; ``columns`` and ``rows``
    give each block's block-column and ``h*Mb + r``. A causal mask keeps a prefix
    of each row: ``causal[h*Mb + r]`` = 2 x (blocks left of the diagonal) + (1 if
    the block-row has its diagonal block), so row ``i`` keeps its first
    ``(causal >> 1) * block + (causal & 1) * (i + 1)`` elements.
    """

    block: int
    heads: int
    block_rows: int
    block_cols: int
    nnz: int
    max_blocks: int
    offsets: torch.Tensor
    columns: torch.Tensor
    rows: torch.Tensor
    causal: torch.Tensor

    @property
    def mean_blocks(self) -> float:
        """Blocks per block-row on average: how long the rows mostly are (``max_blocks``: the longest)."""
        return self.nnz / max(1, self.heads * self.block_rows)


# id(layout) -> (weak reference to layout, {(version, block, device): lut}); entries leave with their layout.
_luts: dict[int, tuple[weakref.ref, dict]] = {}


def _cache_of(layout: torch.Tensor) -> dict:
    key = id(layout)
    entry = _luts.get(key)
    if entry is None or entry[0]() is not layout:
        entry = (weakref.ref(layout, lambda _, key=key: _luts.pop(key, None)), {})
        _luts[key] = entry
    return entry[1]


def _check_block(block) -> int:
    block = _validate.integer(block, "block")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    return block


def lookup_table(layout: torch.Tensor, block: int, device: torch.device | str | None = None) -> BlockSparseLUT:
    """The validated, cached look-up table of ``layout`` on ``device`` (default: the layout's)."""
    _validate.tensor(layout, "layout")
    block = _check_block(block)
    device = torch.device(device) if device is not None else layout.device
    key = (layout._version, block, device)
    cache = _cache_of(layout)
    if key in cache:
        return cache[key]
    if layout.ndim != 3:
        raise ValueError(f"layout must be 3-D (heads, block-rows, block-columns), got shape {tuple(layout.shape)}")
    if layout.is_floating_point() or layout.is_complex():
        raise TypeError(f"layout must be an integer or bool tensor of 0/1, got {layout.dtype}")
    cpu = layout.detach().to("cpu", torch.int64)
    if ((cpu != 0) & (cpu != 1)).any():
        raise ValueError("layout must hold only 0 and 1")
    heads, block_rows, block_cols = cpu.shape
    nonzero = cpu.nonzero()
    counts = cpu.sum(-1).flatten()
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    lut = BlockSparseLUT(
        block=block, heads=heads, block_rows=block_rows, block_cols=block_cols, nnz=nonzero.shape[0],
        max_blocks=int(counts.max()) if counts.numel() else 0,
        offsets=offsets.to(device, torch.int32),
        columns=nonzero[:, 2].to(device, torch.int32),
        rows=(nonzero[:, 0] * block_rows + nonzero[:, 1]).to(device, torch.int32),
        causal=_causal_prefixes(cpu).to(device, torch.int32),
    )
    cache[key] = lut
    return lut


def _causal_prefixes(layout: torch.Tensor) -> torch.Tensor:
    """Per block-row (flattened heads x block-rows): 2 x its blocks left of the diagonal + its diagonal block."""
    _, block_rows, block_cols = layout.shape
    r = torch.arange(block_rows)[:, None]
    c = torch.arange(block_cols)[None, :]
    before = (layout * (c < r)).sum(-1)
    diagonal = (layout * (c == r)).sum(-1)
    return (2 * before + diagonal).flatten()


# -- the kernels of one backend, into torch-allocated outputs


def _forward(x, lut, scale, is_causal, backend):
    out = torch.empty_like(x)
    if x.numel():  # kernels never see an empty tensor (the torch.library ops come here too)
        get_backend(backend).kernels("blocksparse").forward(x, out, lut, scale, is_causal)
    return out


def _backward(y, dy, lut, scale, backend):
    dx = torch.empty_like(y)
    if y.numel():
        get_backend(backend).kernels("blocksparse").backward(y, dy.contiguous(), dx, lut, scale)
    return dx


# -- torch.library ops, used under torch.compile: they take the layout and build (or find) the
#    look-up table when they run, so tracing never touches host data.


def _runtime_lut(blocks: torch.Tensor, name: str, layout: torch.Tensor, block: int) -> BlockSparseLUT:
    lut = lookup_table(layout, block, blocks.device)
    _check_blocks(blocks, name, lut)
    return lut


@torch.library.custom_op("multisoft::blocksparse_forward", mutates_args=())
def blocksparse_forward_op(x: torch.Tensor, layout: torch.Tensor, block: int, scale: float, is_causal: bool,
                           backend: str) -> torch.Tensor:
    return _forward(x, _runtime_lut(x, "x", layout, block), scale, is_causal, backend)


@blocksparse_forward_op.register_fake
def _(x, layout, block, scale, is_causal, backend):
    return torch.empty_like(x)


@torch.library.custom_op("multisoft::blocksparse_backward", mutates_args=())
def blocksparse_backward_op(y: torch.Tensor, dy: torch.Tensor, layout: torch.Tensor, block: int, scale: float,
                            backend: str) -> torch.Tensor:
    return _backward(y, dy, _runtime_lut(y, "y", layout, block), scale, backend)


@blocksparse_backward_op.register_fake
def _(y, dy, layout, block, scale, backend):
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    _, layout, ctx.block, ctx.scale, _, ctx.backend = inputs
    ctx.save_for_backward(output, layout)


def _op_backward(ctx, dy):
    y, layout = ctx.saved_tensors
    dx = blocksparse_backward_op(y, dy, layout, ctx.block, ctx.scale, ctx.backend)
    return dx, None, None, None, None, None


blocksparse_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


# -- autograd Function, the eager path


class _BlockSparseSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lut, scale, is_causal, backend):
        y = _forward(x, lut, scale, is_causal, backend)
        ctx.args = (lut, scale, backend)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        lut, scale, backend = ctx.args
        dx = _backward(y, dy, lut, scale, backend)
        if torch.is_grad_enabled():  # create_graph=True: differentiating dx again must fail by name
            dx = _NoDoubleBackward.apply(dx, y, dy)
        return dx, None, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
    """Passes ``dx`` through, tied to the tensors it was computed from, and raises if it is differentiated."""

    @staticmethod
    def forward(ctx, dx, *sources):
        return dx.view_as(dx)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("multisoft.blocksparse_softmax does not support double backward: its gradient "
                           "(computed with create_graph=True) cannot be differentiated again")


def _check_blocks(x, name, lut):
    _validate.floating(x, name)
    expected = (lut.nnz, lut.block, lut.block)
    if x.ndim != 4 or tuple(x.shape[1:]) != expected:
        raise ValueError(f"{name} must have shape (Z, {lut.nnz}, {lut.block}, {lut.block}) for this layout "
                         f"(nnz={lut.nnz}, block={lut.block}), got {tuple(x.shape)}")


def blocksparse_softmax(x: torch.Tensor, layout: torch.Tensor, block: int, *, scale: float = 1.0,
                        is_causal: bool = False, backend: str | None = None) -> torch.Tensor:
    """Row softmax of ``scale * x`` over the nonzero blocks of ``layout``; differentiable.

    ``x`` is (Z, nnz, block, block) in ``layout.nonzero()`` order; the result
    has the same format. ``is_causal`` masks every absolute column greater than
    the row; a row with nothing unmasked gives zeros. ``scale`` is any finite
    number (0 gives every unmasked element of a row the same share). Inside a
    ``torch.func`` transform it raises ``NotImplementedError``.
    """
    refuse_transforms("blocksparse_softmax")
    _validate.floating(x, "x")
    refuse_tangents("blocksparse_softmax", x=x)
    scale = _validate.finite(scale, "scale")
    is_causal = _validate.boolean(is_causal, "is_causal")
    name = resolve_name(x.device, x.dtype, _validate.backend_name(backend))
    x = x.contiguous()
    if torch.compiler.is_compiling():
        _validate.tensor(layout, "layout")
        return blocksparse_forward_op(x, layout, _check_block(block), scale, is_causal, name)
    lut = lookup_table(layout, block, x.device)
    _check_blocks(x, "x", lut)
    if x.numel() == 0:
        return x.clone()  # no elements, but part of autograd as torch's result would be
    if x.requires_grad and torch.is_grad_enabled():
        return _BlockSparseSoftmax.apply(x, lut, scale, is_causal, name)
    return _forward(x, lut, scale, is_causal, name)


def blocksparse_softmax_backward(y: torch.Tensor, dy: torch.Tensor, layout: torch.Tensor, block: int, *,
                                 scale: float = 1.0, backend: str | None = None) -> torch.Tensor:
    """Gradient of ``blocksparse_softmax`` given its output ``y`` and the incoming ``dy``:
    ``scale * y * (dy - rowsum(y * dy))``, in the compressed format."""
    refuse_transforms("blocksparse_softmax_backward")
    _validate.tensor(y, "y")
    refuse_tangents("blocksparse_softmax_backward", y=y, dy=dy)
    lut = lookup_table(layout, block, y.device)
    _check_blocks(y, "y", lut)
    _check_blocks(dy, "dy", lut)
    _validate.same_device(y, "y", dy=dy)
    if dy.dtype != y.dtype:
        raise TypeError(f"dy must have y's dtype {y.dtype}, got {dy.dtype}")
    if dy.shape != y.shape:
        raise ValueError(f"dy must have y's shape {tuple(y.shape)}, got {tuple(dy.shape)}")
    scale = _validate.finite(scale, "scale")
    name = resolve_name(y.device, y.dtype, _validate.backend_name(backend))
    return _backward(y.contiguous(), dy, lut, scale, name)


def blocksparse_from_dense(dense: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """The nonzero blocks of ``dense`` (Z, H, M, N) under ``layout``: (Z, nnz, block, block)."""
    _validate.tensor(dense, "dense")
    lut = lookup_table(layout, block)
    if dense.ndim != 4:
        raise ValueError(f"dense must be 4-D (Z, H, M, N), got shape {tuple(dense.shape)}")
    z, heads, m, n = dense.shape
    if heads != lut.heads or m % block or n % block or m // block != lut.block_rows or n // block != lut.block_cols:
        raise ValueError(f"dense of shape {tuple(dense.shape)} does not match layout {tuple(layout.shape)} "
                         f"with block {block}: expected (Z, {lut.heads}, {lut.block_rows * block}, "
                         f"{lut.block_cols * block})")
    h, r, c = layout.detach().to("cpu").nonzero().to(dense.device).unbind(1)
    tiles = dense.reshape(z, heads, lut.block_rows, block, lut.block_cols, block).transpose(3, 4)
    return tiles[:, h, r, c].contiguous()


def blocksparse_to_dense(x: torch.Tensor, layout: torch.Tensor, block: int, *, fill: float = 0.0) -> torch.Tensor:
    """The dense (Z, H, M, N) tensor whose nonzero blocks are ``x``; ``fill`` everywhere else."""
    _validate.tensor(x, "x")
    lut = lookup_table(layout, block)
    _check_blocks(x, "x", lut)
    z = x.shape[0]
    dense = x.new_full((z, lut.heads, lut.block_rows, lut.block_cols, block, block), fill)
    h, r, c = layout.detach().to("cpu").nonzero().to(x.device).unbind(1)
    dense[:, h, r, c] = x
    return dense.transpose(3, 4).reshape(z, lut.heads, lut.block_rows * block, lut.block_cols * block)
