"""Per-token log-probabilities and entropy: each row's statistics (`forward`) and the gradient from them (`backward`).

With y = tanh(x / softcap) and scale = softcap / temperature, or y = x and scale = 1 / temperature, u = y * scale.

`forward` reads each row once and writes its max m of u, sum S of exp(u - m) and E = A / S, A = sum exp(u - m) (u - m)
(an element of u = -inf adds 0 to A). Rows of up to LP_TILE_MAX columns (p2) are tiles held in registers, several
rows a program when short; a longer row is streamed by one program in chunks, each element read once, with online
updates of (m, S, A): when the running max moves from m to m', S' = e^{m - m'} S and A' = e^{m - m'} (A + (m - m') S),
then the chunk adds its terms relative to m'.

`backward` has no reduction: each element's gradient du/dx (sum_k g_k [j == t_k] - p_j (a + c ((u_j - m) - E))),
p_j = exp(u_j - m) / S, follows from its row's statistics, coefficients and K (id, incoming gradient) pairs. One grid
walks tiles of rows x columns in memory order; each element is read, then written by the same thread (in place
allowed): one read and one write. An id is compared with the columns, never used as an index.

Both directions compute d = u - s (s the row's max, 0 where that is -inf) and exp(d) the same way, so the backward's
p_j are the terms the forward summed into S. The A term is e * max(d, -FLT_MAX): 0 * -FLT_MAX = 0 where u = -inf
(never 0 * -inf), and still NaN where d is NaN, which e carries into S anyway.

Batch invariance (backends/README.md): the tile, rows a program and warps come from C and the element size only,
never from M, so a row's arithmetic is the same whatever the rows around it.
"""
import triton
import triton.language as tl

from . import _tuning, simulated
from ._device import fast_exp, safe_shift
from ._launch import LAUNCH, launch, next_power_of_2, on_device, warps_for
from .cross_entropy import _capped_softcap, _tanh

_FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _capped(x, mask, inv_softcap, SOFTCAP: tl.constexpr):
    """y of float32 logits x: tanh(x / softcap), -inf outside `mask`, or x itself (the loads' `other` outside it)."""
    y = x
    if SOFTCAP:
        y = tl.where(mask, _tanh(x * inv_softcap), -float("inf"))
    return y


@triton.jit
def _shifted(y, shift, scale, SCALED: tl.constexpr):
    """d = u - shift with u = y * scale (y itself unless SCALED), and exp(d): the terms of S."""
    u = y
    if SCALED:
        u = y * scale
    d = u - shift
    return d, fast_exp(d)


@triton.jit
def _add_pairs(total, weighted, other_total, other_weighted):
    return total + other_total, weighted + other_weighted


if simulated():   # the interpreter runs a reduction's combine function in Python: minutes where tl.sum takes seconds
    @triton.jit
    def _sums(d, e, axis: tl.constexpr):
        return tl.sum(e, axis=axis), tl.sum(e * tl.maximum(d, -_FLOAT32_MAX), axis=axis)
else:
    @triton.jit
    def _sums(d, e, axis: tl.constexpr):
        """(S, A) along `axis`: the sums of exp(d) and of exp(d) * d, the latter 0 where d is -inf (e is 0 there;
        -FLT_MAX keeps 0 * d a 0). One reduction of the pair: each thread adds its terms as it forms them, where two
        reductions, with a barrier between, hold every e and d of the block until the second (sm_90, Triton 3.9:
        a streamed float32 row's program 171 registers, not 125)."""
        return tl.reduce((e, e * tl.maximum(d, -_FLOAT32_MAX)), axis, _add_pairs)


@triton.jit
def _store_row_stats(stats_ptr, M, rows, mask, row_max, total, weighted):
    """row_stats[:, rows] = (m, S, E = A / S); rows (int64) first, so that no 2 * M is formed in 32 bits."""
    tl.store(stats_ptr + rows, row_max, mask=mask)
    tl.store(stats_ptr + (rows + M), total, mask=mask)
    tl.store(stats_ptr + (rows + M + M), weighted / total, mask=mask)


@triton.jit
def _forward_tile_kernel(logits_ptr, stats_ptr, M, C, inv_softcap, scale, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """ROWS whole rows of BLOCK (>= C) columns a program, each read once and reduced in registers."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < C)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    y = _capped(x, mask, inv_softcap, SOFTCAP)
    # scale > 0 and rounding is monotonic: max(y) * scale is max(y * scale), one multiply a row
    row_max = tl.max(y, axis=1)
    if SCALED:
        row_max = row_max * scale
    d, e = _shifted(y, safe_shift(row_max)[:, None], scale, SCALED)
    total, weighted = _sums(d, e, 1)
    _store_row_stats(stats_ptr, M, rows, row_mask, row_max, total, weighted)


@triton.jit
def _forward_loop_kernel(logits_ptr, stats_ptr, M, C, inv_softcap, scale, BLOCK: tl.constexpr,
                         SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """One row a program, streamed once in chunks of BLOCK with online updates of (m, S, A)."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * C
    cols = tl.arange(0, BLOCK)
    run_max = tl.full((), -float("inf"), tl.float32)
    shift = tl.zeros((), tl.float32)      # safe_shift(run_max): what total and weighted are relative to
    total = tl.zeros((), tl.float32)
    weighted = tl.zeros((), tl.float32)
    for start in tl.range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(logits_ptr + row_start + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = _capped(x, mask, inv_softcap, SOFTCAP)
        block_max = tl.max(y, axis=0)
        if SCALED:
            block_max = block_max * scale
        new_max = tl.maximum(run_max, block_max)
        new_shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        # e^{m - m'} from the max as found: 0 while everything seen is -inf (total and weighted are 0 then, and
        # shift - new_shift stays finite, so no 0 * inf); a scalar a chunk, as _device.online_max takes it
        rescale = tl.exp(run_max - new_shift)
        weighted = rescale * (weighted + (shift - new_shift) * total)
        total = rescale * total
        run_max = new_max
        shift = new_shift
        d, e = _shifted(y, shift, scale, SCALED)
        block_total, block_weighted = _sums(d, e, 0)
        total += block_total
        weighted += block_weighted
    _store_row_stats(stats_ptr, M, row, row >= 0, run_max, total, weighted)


@triton.jit
def _backward_kernel(logits_ptr, target_ptr, stats_ptr, grad_target_ptr, coefficients_ptr, grad_ptr, M, C, K,
                     column_tiles, inv_softcap, scale, inv_temperature, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """grad = du/dx (sum_k g_k [j == t_k] - p_j (a + c (d_j - E))) over a tile of ROWS rows x BLOCK columns, the
    tiles numbered along the rows (column_tiles a row block); the p term 0 where u_j = -inf."""
    tile = tl.program_id(0)
    row_block = tile // column_tiles
    rows = row_block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    first_col = (tile - row_block * column_tiles) * BLOCK
    lanes = tl.arange(0, BLOCK)
    cols = first_col + lanes
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < C)[None, :]
    offsets = rows[:, None] * C + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    row_max = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    total = tl.load(stats_ptr + (rows + M), mask=row_mask, other=1.0)
    spread = tl.load(stats_ptr + (rows + M + M), mask=row_mask, other=0.0)   # int64 sums: no 2 * M in 32 bits
    at_all = tl.load(coefficients_ptr + rows, mask=row_mask, other=0.0)
    at_entropy = tl.load(coefficients_ptr + (rows + M), mask=row_mask, other=0.0)
    # p (a + c (d - E)) du/dx = e (slope d + offset) with 1 / S and the 1 / temperature of du/dx folded in a row
    per_total = inv_temperature / total
    slope = at_entropy * per_total
    offset = (at_all - at_entropy * spread) * per_total
    y = _capped(x, mask, inv_softcap, SOFTCAP)
    d, e = _shifted(y, safe_shift(row_max)[:, None], scale, SCALED)
    grad = tl.where(d == -float("inf"), 0.0, -e * (slope[:, None] * d + offset[:, None]))
    for k in tl.range(0, K):
        ids = tl.load(target_ptr + rows * K + k, mask=row_mask, other=-1).to(tl.int64)
        grad_id = tl.load(grad_target_ptr + rows * K + k, mask=row_mask, other=0.0) * inv_temperature
        # an id outside [0, C) matches no column (as a 32-bit -1, so that none wraps onto one)
        ids = tl.where((ids >= 0) & (ids < C), ids - first_col, -1).to(tl.int32)
        grad += tl.where(lanes[None, :] == ids[:, None], grad_id[:, None], 0.0)
    if SOFTCAP:
        grad = grad * (1.0 - y * y)
    tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _scalars(options):
    """(SOFTCAP, SCALED, 1 / softcap, scale, 1 / temperature): u = y * scale, y = tanh(x / softcap) with a cap (scale
    softcap / temperature), else x (scale 1 / temperature, SCALED False where that is 1)."""
    capped, softcap = _capped_softcap(options.softcap)
    inv_temperature = 1.0 / float(options.temperature)
    scale = softcap * inv_temperature if capped else inv_temperature
    return capped, capped or scale != 1.0, 1.0 / softcap, scale, inv_temperature


def forward(logits, row_stats, options):
    """row_stats[:, i] = (m, S, E) of row i of the (M, C) logits, each element read once."""
    M, C = logits.shape
    if M == 0 or C == 0:
        return
    capped, scaled, inv_softcap, scale, _ = _scalars(options)
    block = next_power_of_2(C)
    with on_device(logits):
        if block <= _tuning.LP_TILE_MAX:
            rows = max(1, _tuning.LP_TILE_ELEMENTS // block)   # from C alone, never from M
            launch(_forward_tile_kernel, (triton.cdiv(M, rows),), logits, row_stats, M, C, inv_softcap, scale,
                   ROWS=rows, BLOCK=block, SOFTCAP=capped, SCALED=scaled, num_warps=warps_for(rows * block),
                   **LAUNCH)
        else:
            loop_block, warps = _tuning.LP_LOOP_CONFIGS[logits.element_size()]
            launch(_forward_loop_kernel, (M,), logits, row_stats, M, C, inv_softcap, scale, BLOCK=loop_block,
                   SOFTCAP=capped, SCALED=scaled, num_warps=warps, **LAUNCH)


def backward(logits, target, row_stats, grad_target, row_coefficients, grad_logits, options):
    """grad_logits[i, j] = du_j/dx_j (sum_k g_ik [j == t_ik] - p_j (a_i + c_i ((u_j - m_i) - E_i))) from the forward's
    row_stats, target and grad_target (M, K), row_coefficients (a, c); grad_logits may be logits itself."""
    M, C = logits.shape
    if M == 0 or C == 0:
        return
    capped, scaled, inv_softcap, scale, inv_temperature = _scalars(options)
    size = logits.element_size()
    block = min(next_power_of_2(C), _tuning.LP_BACKWARD_BLOCK[size])
    rows = max(1, _tuning.LP_BACKWARD_ELEMENTS[size] // block)   # from C alone, never from M
    column_tiles = triton.cdiv(C, block)
    grid = (triton.cdiv(M, rows) * column_tiles,)
    with on_device(logits):
        launch(_backward_kernel, grid, logits, target, row_stats, grad_target, row_coefficients, grad_logits, M, C,
               target.shape[1], column_tiles, inv_softcap, scale, inv_temperature, ROWS=rows, BLOCK=block,
               SOFTCAP=capped, SCALED=scaled, num_warps=warps_for(rows * block), **LAUNCH)
