"""Block-sparse softmax: the look-up table, torch.library ops, autograd, public functions.

The compressed format is the block-sparse attention libraries': ``layout`` is a
0/1 tensor (H, M/block, N/block) and ``x`` (Z, nnz, block, block) holds the
nonzero blocks in ``layout.nonzero()`` order (head, block-row, block-column).

A look-up table is derived from a private copy of the layout's contents, taken
when the table is built, and never from the live tensor again. Each call makes
sure that copy still holds what the layout holds now, whatever wrote to it
(indexing, ``.data``, a NumPy view; ``_version`` does not see the last two):
a layout on the CPU is compared on the host (``torch.equal``) and, if it
changed, read again; a layout on a GPU is compared on its device, in the
call's stream, by a device-side assertion that fails if it changed (no host
synchronisation). A ``BlockSparseLayout`` is read once and owns its tables:
nothing to compare.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import _validate
from ._forward_ad import refuse_tangents, refuse_transforms
from ._registry import get_backend, resolve_name

BLOCKS = (16, 32, 64, 128)

# What a device-side assertion prints (torch keeps at most 255 characters; torch < 2.7 prints none on CUDA).
CHANGED_ON_DEVICE = ("multisoft: a block-sparse layout on the GPU was written in place after its look-up table was "
                     "built from it; pass a new tensor, or a multisoft.BlockSparseLayout")


@dataclass(frozen=True)
class BlockSparseLUT:
    """Where each block-row's blocks are, built once per (layout contents, block, device).

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


def _check_block(block) -> int:
    block = _validate.integer(block, "block")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    return block


class _Tables:
    """A layout's contents, read and validated once, and the look-up tables derived from them per (block, device).

    ``contents`` is a private CPU copy in the layout's dtype that nothing writes: every table comes from it.
    """

    def __init__(self, layout: torch.Tensor):
        if layout.ndim != 3:
            raise ValueError(f"layout must be 3-D (heads, block-rows, block-columns), got shape {tuple(layout.shape)}")
        if layout.is_floating_point() or layout.is_complex():
            raise TypeError(f"layout must be an integer or bool tensor of 0/1, got {layout.dtype}")
        contents = layout.detach().to("cpu", copy=True)   # a layout on a GPU: one synchronisation, here only
        if ((contents != 0) & (contents != 1)).any():
            raise ValueError("layout must hold only 0 and 1")
        self.contents = contents
        self._luts: dict[tuple[int, torch.device], BlockSparseLUT] = {}

    def lut(self, block: int, device: torch.device) -> BlockSparseLUT:
        key = (block, device)
        lut = self._luts.get(key)
        if lut is None:
            lut = self._luts[key] = _build(self.contents.to(torch.int64), block, device)
        return lut


def _build(layout: torch.Tensor, block: int, device: torch.device) -> BlockSparseLUT:
    heads, block_rows, block_cols = layout.shape
    nonzero = layout.nonzero()
    counts = layout.sum(-1).flatten()
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return BlockSparseLUT(
        block=block, heads=heads, block_rows=block_rows, block_cols=block_cols, nnz=nonzero.shape[0],
        max_blocks=int(counts.max()) if counts.numel() else 0,
        offsets=offsets.to(device, torch.int32),
        columns=nonzero[:, 2].to(device, torch.int32),
        rows=(nonzero[:, 0] * block_rows + nonzero[:, 1]).to(device, torch.int32),
        causal=_causal_prefixes(layout).to(device, torch.int32),
    )


def _causal_prefixes(layout: torch.Tensor) -> torch.Tensor:
    """Per block-row (flattened heads x block-rows): 2 x its blocks left of the diagonal + its diagonal block."""
    _, block_rows, block_cols = layout.shape
    r = torch.arange(block_rows)[:, None]
    c = torch.arange(block_cols)[None, :]
    before = (layout * (c < r)).sum(-1)
    diagonal = (layout * (c == r)).sum(-1)
    return (2 * before + diagonal).flatten()


class BlockSparseLayout:
    """A block-sparse layout read once, which owns its look-up tables.

    ``BlockSparseLayout(layout, block)`` validates the 0/1 tensor ``layout`` (H, M/block, N/block), on any device,
    and copies it (a layout on a GPU is read with one host synchronisation, here). Pass the object wherever a
    ``layout`` is taken, with the same ``block``: ``blocksparse_softmax``, ``blocksparse_softmax_backward``,
    ``blocksparse_from_dense``, ``blocksparse_to_dense``, under ``torch.compile`` too. Its look-up table is built
    on first use on each device and kept; calls skip the check that a plain layout tensor gets each time (that
    its contents did not change). ``layout`` is never read again: later writes to it do not change this object.
    """

    def __init__(self, layout: torch.Tensor, block: int):
        _validate.tensor(layout, "layout")
        self._block = _check_block(block)
        self._tables = _Tables(layout)
        _owned[id(self._tables.contents)] = self._tables
        self._nnz = int(self._tables.contents.count_nonzero())

    @property
    def block(self) -> int:
        """The side of a block, in elements."""
        return self._block

    @property
    def shape(self) -> torch.Size:
        """(H, M/block, N/block)."""
        return self._tables.contents.shape

    @property
    def nnz(self) -> int:
        """The number of nonzero blocks: ``x`` is (Z, nnz, block, block)."""
        return self._nnz

    def tensor(self) -> torch.Tensor:
        """A copy of the layout as it was read, on the CPU."""
        return self._tables.contents.clone()

    def __repr__(self) -> str:
        heads, block_rows, block_cols = self.shape
        return (f"BlockSparseLayout(heads={heads}, block_rows={block_rows}, block_cols={block_cols}, "
                f"block={self.block}, nnz={self.nnz})")

    def _same_block(self, block) -> int:
        block = _validate.integer(block, "block")
        if block != self._block:
            raise ValueError(f"block must be the BlockSparseLayout's block, {self._block}, got {block}")
        return block


@dataclass(frozen=True)
class _Entry:
    """The tables of one layout tensor's contents, as read (``where``: its shape, dtype and device then)."""

    layout: weakref.ref
    tables: _Tables
    where: tuple
    on_device: torch.Tensor | None   # ``tables.contents`` on the layout's device; None for a layout on the CPU


# id(layout) -> its _Entry; an entry leaves with its layout.
_entries: dict[int, _Entry] = {}
# id(contents) -> the _Tables of a BlockSparseLayout: the tensor the compiled path hands the ops for it.
_owned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _entry_of(layout: torch.Tensor, reread: bool = True) -> _Entry:
    """``layout``'s entry, read again if it is on the CPU and its contents differ from those its tables came from,
    or if ``.data`` gave it another shape, dtype or device (``reread=False``: raise ValueError instead). A layout
    on a GPU is not compared here (that would wait for the device): see ``_check_unchanged``."""
    key = id(layout)
    entry = _entries.get(key)
    where = (layout.shape, layout.dtype, layout.device)
    if entry is not None and entry.layout() is layout:
        if entry.where == where and (entry.on_device is not None or torch.equal(layout, entry.tables.contents)):
            return entry
        if not reread:
            raise ValueError("layout was written in place between a torch.compile'd blocksparse_softmax and its "
                             "backward, which reads it again there; write it after the backward, or pass a "
                             "multisoft.BlockSparseLayout")
    tables = _Tables(layout)
    on_device = None if layout.device.type == "cpu" else tables.contents.to(layout.device)
    entry = _Entry(weakref.ref(layout, lambda _, key=key: _entries.pop(key, None)), tables, where, on_device)
    _entries[key] = entry
    return entry


def _check_unchanged(layout: torch.Tensor, entry: _Entry) -> None:
    """Enqueue, in the current stream of the layout's device, an assertion that it still holds what its tables
    came from: three small kernels, no synchronisation, capturable in a CUDA graph."""
    torch._assert_async(torch.eq(layout, entry.on_device).all(), CHANGED_ON_DEVICE)


def _layout_argument(layout) -> None:
    if not isinstance(layout, (torch.Tensor, BlockSparseLayout)):
        raise TypeError(f"layout must be a torch.Tensor or a multisoft.BlockSparseLayout, got {type(layout).__name__}")


def _no_check(lut: BlockSparseLUT) -> None:
    pass


def _table(layout, block, device: torch.device, check=_no_check, reread: bool = True) -> BlockSparseLUT:
    """The look-up table of ``layout`` (a tensor, as it is now, or a BlockSparseLayout) for ``block`` on
    ``device``, once ``check(lut)`` found the call's tensors fit it (it raises ValueError if not);
    ``reread=False``: a changed layout on the CPU raises ValueError rather than being read again.

    For a layout on a GPU the contents are compared on the device, after ``check`` passed; if ``check`` fails
    there, the layout is read again (a synchronisation, on the error path only), so that the error says the
    layout changed rather than blame a tensor that fits the layout as it is now.
    """
    _layout_argument(layout)
    if isinstance(layout, BlockSparseLayout):
        lut = layout._tables.lut(layout._same_block(block), device)
        check(lut)
        return lut
    block = _check_block(block)
    owned = _owned.get(id(layout))
    if owned is not None and owned.contents is layout:
        lut = owned.lut(block, device)
        check(lut)
        return lut
    entry = _entry_of(layout, reread)
    lut = entry.tables.lut(block, device)
    if entry.on_device is None:
        check(lut)
        return lut
    try:
        check(lut)
    except ValueError:
        if not torch.equal(layout.detach().to("cpu"), entry.tables.contents):
            raise ValueError(f"layout (on {layout.device}) was written in place after its look-up table was built "
                             "from it: a layout on a GPU is read once and then only compared on the device; pass a "
                             "new tensor, or a multisoft.BlockSparseLayout") from None
        raise
    _check_unchanged(layout, entry)
    return lut


def lookup_table(layout, block: int, device: torch.device | str | None = None) -> BlockSparseLUT:
    """The validated, cached look-up table of ``layout`` as it is now (a tensor, or a BlockSparseLayout) on
    ``device`` (default: the layout tensor's device; the CPU for a BlockSparseLayout)."""
    _layout_argument(layout)
    if device is not None:
        device = torch.device(device)
    else:
        device = layout.device if isinstance(layout, torch.Tensor) else torch.device("cpu")
    return _table(layout, block, device)


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
#    look-up table when they run, so tracing never touches host data. A BlockSparseLayout comes to them as the
#    copy it owns (an op's arguments are tensors and numbers), which finds its own tables.


def _runtime_lut(blocks: torch.Tensor, name: str, layout: torch.Tensor, block: int,
                 reread: bool = True) -> BlockSparseLUT:
    return _table(layout, block, blocks.device, lambda lut: _check_blocks(blocks, name, lut), reread)


def _op_layout(layout, block) -> tuple[torch.Tensor, int]:
    """The ``layout`` and ``block`` that the torch.library ops take: the tensor, or a BlockSparseLayout's own copy
    (nothing writes to it)."""
    _layout_argument(layout)
    if isinstance(layout, BlockSparseLayout):
        return layout._tables.contents, layout._same_block(block)
    return layout, _check_block(block)


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
    # The backward of a compiled forward: it must use the forward's table, so a layout written since raises.
    return _backward(y, dy, _runtime_lut(y, "y", layout, block, reread=False), scale, backend)


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


def blocksparse_softmax(x: torch.Tensor, layout: torch.Tensor | BlockSparseLayout, block: int, *,
                        scale: float = 1.0, is_causal: bool = False, backend: str | None = None) -> torch.Tensor:
    """Row softmax of ``scale * x`` over the nonzero blocks of ``layout``; differentiable.

    ``x`` is (Z, nnz, block, block) in ``layout.nonzero()`` order; the result
    has the same format. ``is_causal`` masks every absolute column greater than
    the row; a row with nothing unmasked gives zeros. ``scale`` is any finite
    number (0 gives every unmasked element of a row the same share). Inside a
    ``torch.func`` transform it raises ``NotImplementedError``.

    ``layout`` is a 0/1 tensor (H, M/block, N/block) or a ``BlockSparseLayout``
    of the same ``block``. A tensor's look-up table is cached and used for the
    contents it was built from: on the CPU each call compares the layout with
    them (on the host) and builds the table again if it changed; on a GPU each
    call compares them on the device, without waiting for it, and a layout
    written since makes that comparison fail a device-side assertion (the next
    synchronisation raises) rather than give a result for the old contents.
    The backward uses the forward's table.
    """
    refuse_transforms("blocksparse_softmax")
    _validate.floating(x, "x")
    refuse_tangents("blocksparse_softmax", x=x)
    scale = _validate.finite(scale, "scale")
    is_causal = _validate.boolean(is_causal, "is_causal")
    name = resolve_name(x.device, x.dtype, _validate.backend_name(backend), "blocksparse")
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return blocksparse_forward_op(x, *_op_layout(layout, block), scale, is_causal, name)
    lut = _table(layout, block, x.device, lambda lut: _check_blocks(x, "x", lut))
    if x.numel() == 0:
        return x.clone()  # no elements, but part of autograd as torch's result would be
    if x.requires_grad and torch.is_grad_enabled():
        return _BlockSparseSoftmax.apply(x, lut, scale, is_causal, name)
    return _forward(x, lut, scale, is_causal, name)


def blocksparse_softmax_backward(y: torch.Tensor, dy: torch.Tensor, layout: torch.Tensor | BlockSparseLayout,
                                 block: int, *, scale: float = 1.0, backend: str | None = None) -> torch.Tensor:
    """Gradient of ``blocksparse_softmax`` given its output ``y`` and the incoming ``dy``:
    ``scale * y * (dy - rowsum(y * dy))``, in the compressed format, for ``layout`` as it is now
    (as ``blocksparse_softmax`` reads it)."""
    refuse_transforms("blocksparse_softmax_backward")
    _validate.floating(y, "y")
    _validate.floating(dy, "dy")
    refuse_tangents("blocksparse_softmax_backward", y=y, dy=dy)
    _validate.same_device(y, "y", dy=dy)
    if dy.dtype != y.dtype:
        raise TypeError(f"dy must have y's dtype {y.dtype}, got {dy.dtype}")
    if dy.shape != y.shape:
        raise ValueError(f"dy must have y's shape {tuple(y.shape)}, got {tuple(dy.shape)}")
    scale = _validate.finite(scale, "scale")
    name = resolve_name(y.device, y.dtype, _validate.backend_name(backend), "blocksparse")
    lut = _table(layout, block, y.device, lambda lut: _check_blocks(y, "y", lut))   # dy has y's shape
    return _backward(y.contiguous(), dy, lut, scale, name)


def blocksparse_from_dense(dense: torch.Tensor, layout: torch.Tensor | BlockSparseLayout, block: int) -> torch.Tensor:
    """The nonzero blocks of ``dense`` (Z, H, M, N) under ``layout`` as it is now: (Z, nnz, block, block), in
    the order of the look-up table that ``blocksparse_softmax`` uses (``layout.nonzero()``'s)."""
    _validate.tensor(dense, "dense")

    def fits(lut):
        if dense.ndim != 4:
            raise ValueError(f"dense must be 4-D (Z, H, M, N), got shape {tuple(dense.shape)}")
        expected = (lut.heads, lut.block_rows * lut.block, lut.block_cols * lut.block)
        if tuple(dense.shape[1:]) != expected:
            raise ValueError(f"dense of shape {tuple(dense.shape)} does not match layout "
                             f"({lut.heads}, {lut.block_rows}, {lut.block_cols}) with block {lut.block}: "
                             f"expected (Z, {', '.join(map(str, expected))})")

    lut = _table(layout, block, dense.device, fits)
    tiles = dense.reshape(dense.shape[0], lut.heads * lut.block_rows, lut.block, lut.block_cols, lut.block)
    return tiles.transpose(2, 3)[:, lut.rows.long(), lut.columns.long()].contiguous()


def blocksparse_to_dense(x: torch.Tensor, layout: torch.Tensor | BlockSparseLayout, block: int, *,
                         fill: float = 0.0) -> torch.Tensor:
    """The dense (Z, H, M, N) tensor whose nonzero blocks under ``layout`` as it is now are ``x``; ``fill``
    everywhere else."""
    _validate.tensor(x, "x")
    lut = _table(layout, block, x.device, lambda lut: _check_blocks(x, "x", lut))
    z, b = x.shape[0], lut.block
    dense = x.new_full((z, lut.heads * lut.block_rows, lut.block_cols, b, b), fill)
    dense[:, lut.rows.long(), lut.columns.long()] = x
    return dense.transpose(2, 3).reshape(z, lut.heads, lut.block_rows * b, lut.block_cols * b)
