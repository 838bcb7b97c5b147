"""Block-sparse softmax of rows holding NaN, +inf or -inf, rows of nothing but -inf and rows with nothing unmasked
(causal), forward and backward, on every backend: the contract of backends/README.md ("Non-finite values").

Expected values are dense float64 ``torch.softmax`` over each row's unmasked elements (0 at masked ones, zeros
for a row with none) and torch's softmax backward over them (0 wherever the output is 0). Every backend runs a
small layout on the kernels it picks by default; the triton, numba and cupy backends also run a layout of
block-rows of up to 9 blocks (cupy: 18) with their knobs set so that these short rows reach each of their kernel
variants (rows held in part and streamed, several rows a program, rows across a warp's lanes, lanes of a row
merged, stashed and re-read tiles, 16-bit rows held as words or as floats, unaligned rows, tile and loop kernels,
staged and register kernels)."""

from __future__ import annotations

import pytest
import torch

import multisoft
from harness import DEVICE, assert_close, backends_under_test
from multisoft.check import DTYPES, error_ratio, reference_blocksparse, reference_blocksparse_backward

BACKENDS = backends_under_test()
NAN, INF = float("nan"), float("inf")
BLOCK = 16
SCALES = (-0.7, 0.0, 0.7)   # a negative scale flips an infinity's sign, a zero one makes 0 * inf = NaN

# What each row of a batch gets, in turn (None: left finite). A row's "first" and "last" elements are its first and
# last unmasked ones; "hidden" ones are masked elements of its stored blocks (causal only: past the diagonal).
PLANTS = ("nan-last", "nan-first", "inf-last", None, "inf-first", "some-neginf", "all-neginf", "neginf-but-nan",
          "neginf-and-inf", None, "hidden-nan-inf", "neginf-hidden-nan")


def _stored(layout: torch.Tensor) -> torch.Tensor:
    """(H, M, N) True at the elements of the layout's stored blocks."""
    return layout.bool().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)


def _unmasked(layout: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """(H, M, N) True at the elements a row is normalised over: stored, and (causal) not past the diagonal."""
    stored = _stored(layout)
    if is_causal:
        stored = stored & torch.ones(stored.shape[1:], dtype=torch.bool).tril()
    return stored


def _plant(row: torch.Tensor, kept: torch.Tensor, hidden: torch.Tensor, plant: str | None) -> None:
    """Puts `plant`'s non-finite values into the dense row (kept, hidden: its unmasked and masked stored columns)."""
    if not len(kept):
        row[hidden] = NAN   # a row with nothing unmasked ignores what its masked elements hold
        return
    if plant is None:
        return
    first, middle, last = kept[0], kept[len(kept) // 2], kept[-1]
    if plant == "nan-last":
        row[last] = NAN
    elif plant == "nan-first":
        row[first] = NAN
    elif plant == "inf-last":
        row[last] = INF
    elif plant == "inf-first":
        row[first] = INF
    elif plant == "some-neginf":
        row[kept[::3]] = -INF
    elif plant == "all-neginf":
        row[:] = -INF
    elif plant == "neginf-but-nan":
        row[kept] = -INF
        row[middle] = NAN
    elif plant == "neginf-and-inf":
        row[first] = -INF
        row[last] = INF
    elif plant == "hidden-nan-inf":   # without hidden elements: an ordinary row
        row[hidden[::2]] = NAN
        row[hidden[1::2]] = INF
    elif plant == "neginf-hidden-nan":
        row[kept] = -INF
        row[hidden] = NAN


def _planted_blocks(layout: torch.Tensor, is_causal: bool, z: int, dtype: torch.dtype) -> torch.Tensor:
    """(z, nnz, B, B) scores of `dtype`: random, each row planted with the next of PLANTS."""
    stored, unmasked = _stored(layout), _unmasked(layout, is_causal)
    heads, m, n = stored.shape
    dense = torch.randn(z, heads, m, n) * 2
    rows = ((b, h, i) for b in range(z) for h in range(heads) for i in range(m) if stored[h, i].any())
    for k, (b, h, i) in enumerate(rows):
        kept = unmasked[h, i].nonzero().flatten()
        hidden = (stored[h, i] & ~unmasked[h, i]).nonzero().flatten()
        _plant(dense[b, h, i], kept, hidden, PLANTS[k % len(PLANTS)])
    return multisoft.blocksparse_from_dense(dense, layout, BLOCK).to(DEVICE, dtype)


def _expected_forward(x: torch.Tensor, layout: torch.Tensor, scale: float, is_causal: bool) -> torch.Tensor:
    """softmax(scale * x) of each row over its unmasked elements, one row at a time, in float64."""
    scores = multisoft.blocksparse_to_dense(x.detach().cpu().double() * scale, layout, BLOCK)
    unmasked = _unmasked(layout, is_causal)
    y = torch.zeros_like(scores)
    for b in range(scores.shape[0]):
        for h, i in unmasked.any(-1).nonzero().tolist():
            kept = unmasked[h, i]
            y[b, h, i, kept] = torch.softmax(scores[b, h, i, kept], 0)
    return multisoft.blocksparse_from_dense(y, layout, BLOCK)


def _expected_backward(y: torch.Tensor, dy: torch.Tensor, layout: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's softmax backward of each row (scale * y * (dy - sum(y * dy))) in float64, 0 wherever y is 0."""
    y64 = multisoft.blocksparse_to_dense(y.detach().cpu().double(), layout, BLOCK)
    dy64 = multisoft.blocksparse_to_dense(dy.detach().cpu().double(), layout, BLOCK)
    dx = scale * torch._softmax_backward_data(dy64, y64, -1, torch.float64)
    return multisoft.blocksparse_from_dense(dx.masked_fill(y64 == 0, 0.0), layout, BLOCK)


def _small_layout() -> torch.Tensor:
    """2 heads of 4 x 4 blocks: block-rows of 1 to 4 blocks, one empty, one only above the diagonal."""
    layout = torch.tensor([[[1, 0, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]],
                           [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 1, 1]]])
    return layout


def _long_layout(longest: int) -> torch.Tensor:
    """1 head of 10 x 20 blocks: block-rows of 1 to `longest` blocks (block-row 9, in columns 0 on), three empty.
    Causal: block-rows 0 and 8 have only blocks past the diagonal (nothing unmasked), 4 only the diagonal block, 2,
    5 and 7 blocks on either side of it, 9 all its blocks up to the diagonal."""
    columns = {0: [5], 2: [0, 2, 9], 4: [4], 5: [1, 3, 5, 6, 14], 7: [0, 2, 3, 4, 5, 6, 7, 10, 13],
               8: [19], 9: list(range(longest))}
    layout = torch.zeros(1, 10, 20, dtype=torch.long)
    for r, blocks in columns.items():
        layout[0, r, blocks] = 1
    return layout


def _check(backend, layout, dtype, is_causal, forward=True, backward=True, unaligned=False, z=2):
    """The forward at each of SCALES (the blocks planted anew each time), then the backward of the last: through
    autograd and multisoft.blocksparse_softmax_backward (given `unaligned` rows), from the forward's output, or
    from the float64 reference's, rounded, where `forward` is False; `unaligned`: the forward's x and the direct
    backward's y and dy start one element past an aligned address."""
    for scale in SCALES if forward else SCALES[-1:]:
        x = _planted_blocks(layout, is_causal, z, dtype)
        expected = _expected_forward(x, layout, scale, is_causal)
        if not forward:
            y = expected.to(DEVICE, dtype)
            break
        x_in = (_shifted_copy(x) if unaligned else x).requires_grad_(backward)
        y = multisoft.blocksparse_softmax(x_in, layout, BLOCK, scale=scale, is_causal=is_causal, backend=backend)
        assert_close(y, expected, dtype, f"forward, scale {scale}")
    if not backward:
        return
    dy = torch.randn(y.shape).to(DEVICE, dtype)
    if forward:
        (dx,) = torch.autograd.grad(y, x_in, dy)
        _assert_backward(dx, y, dy, layout, scale, dtype, "backward")
    # the direct backward also from zeros in rows that hold NaN (no forward gives those): 0 there too
    y = y.detach().clone()
    y.view(-1)[::7] = 0
    if unaligned:
        y, dy = _shifted_copy(y), _shifted_copy(dy)
    dx = multisoft.blocksparse_softmax_backward(y, dy, layout, BLOCK, scale=scale, backend=backend)
    _assert_backward(dx, y, dy, layout, scale, dtype, "blocksparse_softmax_backward")


def _assert_backward(dx, y, dy, layout, scale, dtype, what):
    _, magnitude = reference_blocksparse_backward(y, dy, layout, BLOCK, scale)
    assert_close(dx, _expected_backward(y, dy, layout, scale), dtype, what, magnitude)


def _shifted_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a tensor whose data starts one element past an aligned address (no vector access)."""
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return shifted.copy_(t)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_rows(backend, dtype, is_causal):
    """Each plant of PLANTS in rows of every length of a small layout, at a scale of either sign and 0, forward
    and backward."""
    _check(backend, _small_layout(), dtype, is_causal)


# Kernel variants by backend: knobs (the backend's _tuning settings, or its blocksparse module's), the directions
# run, the (dtype, unaligned) cases run. The long layout's mean row is 2.9 blocks of 16 (3.8 with the cupy backend's
# longest row, LONGEST_ROW).
BOTH = ("forward", "backward")
FLOAT32_AND_BFLOAT16 = ((torch.float32, False), (torch.bfloat16, False))
VARIANTS = {
    "triton": {
        # 4 blocks of a row held, the rest streamed twice; 4 rows a program
        "rows": ({"FORWARD_ACROSS_UNTIL": {4: 0, 2: 0}, "ROW_HELD": 64, "ROW_MIN_BLOCKS": {4: 1, 2: 1}}, BOTH,
                 FLOAT32_AND_BFLOAT16),
        # the same, a row a program (the interpreter runs 4x the programs: float32 only)
        "one-row-programs": ({"FORWARD_ACROSS_UNTIL": {4: 0, 2: 0}, "ROW_HELD": 64, "ROW_MIN_BLOCKS": {4: 1, 2: 1},
                              "FORWARD_ONE_ROW_FROM": {4: 16, 2: 16}}, ("forward",), ((torch.float32, False),)),
        # rows across a warp's lanes, 4 blocks held, the rest streamed
        "across": ({"FORWARD_ACROSS_UNTIL": {4: 1e9, 2: 1e9}, "FORWARD_ACROSS_BLOCKS": {4: 4, 2: 4}}, ("forward",),
                   FLOAT32_AND_BFLOAT16),
        # one launch per power of two of the block count: tiles up to 4 blocks, the loop kernel beyond
        "tiles-and-loop": ({"TILES_FROM": {4: 0, 2: 0}, "BLOCKSPARSE_TILE_MAX": 64, "BUCKETS_SAVE": {4: 0.0, 2: 0.0}},
                           ("backward",), FLOAT32_AND_BFLOAT16),
    },
    "numba": {
        # 4 lanes a row (their pairs merged), 2 values a lane: rows of many tiles, grid-stride over the rows
        "lanes": ({"BLOCKSPARSE_SIMULATOR_LANES": 4, "BLOCKSPARSE_SIMULATOR_FLOATS": 2, "BLOCKSPARSE_SIMULATOR_GRID": 3,
                   "BLOCKSPARSE_MAX_GRID": 3, "BLOCKSPARSE_FORWARD_FLOATS": {4: (2,), 2: (2,)},
                   "BLOCKSPARSE_BACKWARD_FLOATS": {4: (2,), 2: (2,)}}, BOTH, FLOAT32_AND_BFLOAT16),
        # no tile kept in shared memory: the second pass reads every tile but the last again; 16-bit rows that are
        # not aligned are read an element at a time, as floats
        "re-read": ({"BLOCKSPARSE_STASH_BYTES": 0, "BLOCKSPARSE_BACKWARD_STASH_TILES": 0}, BOTH,
                    FLOAT32_AND_BFLOAT16 + ((torch.bfloat16, True),)),
        # 16-bit rows as floats, not as their words
        "floats": ({"BLOCKSPARSE_PACK_16BIT": False}, BOTH, ((torch.bfloat16, False),)),
    },
    "cupy": {
        # rows staged in shared memory (float32 rows of 18 blocks in parts), several a warp; the backward's
        # register kernel; rows that are not aligned take the register kernels, elementwise
        "staged": ({}, BOTH, FLOAT32_AND_BFLOAT16 + ((torch.bfloat16, True), (torch.float32, True))),
        # the forward's register kernel, a warp a row
        "registers": ({"blocksparse_staged_config": lambda *args: None}, ("forward",), FLOAT32_AND_BFLOAT16),
    },
}
LONGEST_ROW = {"cupy": 18}   # blocks: more than the 64 16-byte vectors of the smallest staged buffer


def _variant_cases():
    for backend in BACKENDS:
        for variant, (_, _, cases) in VARIANTS.get(backend, {}).items():
            for dtype, unaligned in cases:
                name = f"{backend}-{variant}-{str(dtype).replace('torch.', '')}{'-unaligned' * unaligned}"
                yield pytest.param(backend, variant, dtype, unaligned, id=name)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend, variant, dtype, unaligned", list(_variant_cases()))
def test_nonfinite_rows_on_each_kernel_variant(backend, variant, dtype, unaligned, is_causal, monkeypatch):
    """The plants in rows of up to 9 blocks (cupy: 18) on each kernel variant (VARIANTS), the forward at a scale of
    either sign and 0; a batch of one."""
    import importlib
    import importlib.util

    modules = [importlib.import_module(f"multisoft_{backend}.{name}") for name in ("_tuning", "blocksparse")
               if importlib.util.find_spec(f"multisoft_{backend}.{name}") is not None]
    knobs, directions, _ = VARIANTS[backend][variant]
    for name, value in knobs.items():
        owner = next((module for module in modules if hasattr(module, name)), None)
        assert owner is not None, f"{backend} has no setting {name}"
        monkeypatch.setattr(owner, name, value)
    _check(backend, _long_layout(LONGEST_ROW.get(backend, 9)), dtype, is_causal, "forward" in directions,
           "backward" in directions, unaligned, z=1)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_references_follow_dense_softmax_over_the_unmasked_elements(is_causal):
    """multisoft.check's float64 references, which the other block-sparse tests compare with, give what dense
    torch.softmax and its backward give over each row's unmasked elements, non-finite rows included."""
    for layout in (_small_layout(), _long_layout(18)):
        for scale in SCALES:
            x = _planted_blocks(layout, is_causal, 2, torch.float64)
            y = reference_blocksparse(x, layout, BLOCK, scale, is_causal)
            expected = _expected_forward(x, layout, scale, is_causal)
            assert y.isnan().any() and error_ratio(y, expected, torch.float64)[1] <= 1.0, scale
            dy = torch.randn_like(y)
            dx, _ = reference_blocksparse_backward(y, dy, layout, BLOCK, scale)
            assert error_ratio(dx, _expected_backward(y, dy, layout, scale), torch.float64)[1] <= 1.0, scale
