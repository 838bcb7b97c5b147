"""Per-token log-probabilities' row statistics (m, S, E) in one read of the logits, and their gradient in one read and
one write, from log_probs.cu. Every launch parameter that changes a row's arithmetic comes from C and the dtype
(_tuning.lp_fwd_config), never from the row count: a row's results are the same whatever the batch."""

from __future__ import annotations

from . import _instances, _tuning
from ._launch import aligned, ctype, f32, i32, i64, index_ctype, launch, ptr
from .cross_entropy import _kernel_softcap

SOURCE = _instances.LOG_PROBS_SOURCE


def forward(logits, row_stats, options) -> None:
    """row_stats (3, M) = each row's max m of u, S = sum exp(u - m) and E = sum exp(u - m) (u - m) / S, u the capped
    logits over the temperature: a row group (warp or block) per row reads it once."""
    rows, classes = logits.shape
    elem = logits.element_size()
    cfg = _tuning.lp_fwd_config(classes, elem)
    softcap = _kernel_softcap(options.softcap)
    # vectors or single elements, a thread takes the same columns in the same order (log_probs.cu)
    vec = classes % (16 // elem) == 0 and aligned(logits)
    args = (ptr(logits), ptr(row_stats), i64(rows), i64(classes), f32(softcap), f32(1.0 / options.temperature),
            i32(vec))
    expression = _instances.lp_fwd_kernel(ctype(logits.dtype), softcap != 0, cfg)
    launch(logits, SOURCE, expression, (_tuning.grid_blocks(rows, cfg), 1, 1), (cfg.threads, 1, 1), args)


def backward(logits, target, row_stats, grad_target, row_coefficients, grad_logits, options) -> None:
    """grad_logits = du/dx * (sum_k g_k [j == t_k] - p_j (a + c ((u_j - m) - E))) from the forward's row_stats, the
    ids target (M, K), their incoming gradients grad_target (M, K) and (a, c) = row_coefficients[:, i]: a block per
    tile of a row and per row; grad_logits may be logits itself."""
    rows, classes = logits.shape
    ids_a_row = target.shape[1]
    elem = logits.element_size()
    cfg = _tuning.LP_BWD_CONFIG
    softcap = _kernel_softcap(options.softcap)
    vec = classes % (16 // elem) == 0 and aligned(logits, grad_logits)
    args = (ptr(logits), ptr(target), ptr(row_stats), ptr(grad_target), ptr(row_coefficients), ptr(grad_logits),
            i64(rows), i64(classes), i64(ids_a_row), f32(softcap), f32(1.0 / options.temperature), i32(vec))
    expression = _instances.lp_bwd_kernel(ctype(logits.dtype), index_ctype(target.dtype), softcap != 0, cfg)
    launch(logits, SOURCE, expression, _tuning.lp_bwd_grid(rows, classes, elem), (cfg.threads, 1, 1), args)
