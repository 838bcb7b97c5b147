"""The CUDA sources of the CuPy backend and every kernel instance a call may launch; imports no CUDA framework.

An instance is named by a C++ name expression (``softmax_fwd<float, 32, 4, 2>``):
the functions here build the one a _tuning configuration takes, and
``expressions`` lists every instance of a source that some configuration can
take. tests/test_cuda_sources_compile.py compiles exactly that list with NVRTC,
so every launchable kernel is compiled in CI.
"""

from __future__ import annotations

import itertools
import pathlib

from . import _tuning
from ._tuning import BlockSparseStaged, RowConfig, SplitConfig, StagedConfig

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
SOFTMAX_ROWS_SOURCE = "softmax_rows.cu"
SOFTMAX_STAGED_SOURCE = "softmax_staged.cu"
SOFTMAX_SPLIT_SOURCE = "softmax_split.cu"
CROSS_ENTROPY_SOURCE = "cross_entropy.cu"
BLOCKSPARSE_SOURCE = "blocksparse.cu"
LOG_PROBS_SOURCE = "log_probs.cu"
SOURCES = (SOFTMAX_ROWS_SOURCE, SOFTMAX_STAGED_SOURCE, SOFTMAX_SPLIT_SOURCE, CROSS_ENTROPY_SOURCE, BLOCKSPARSE_SOURCE,
           LOG_PROBS_SOURCE)
HEADERS = ("common.cuh",)
CUDA_TYPES = ("float", "f16_t", "bf16_t")
INDEX_TYPES = ("int", "long long")
OPTIONS = ("--std=c++17", f"-I{PACKAGE_DIR}")
SPLIT_COUNTER_STRIDE = 32  # int32s between two rows' counters of the split kernels: MS_COUNTER_STRIDE there

_DIRECTIONS = ("fwd", "bwd")


def _row_kernel(name: str, ctype: str, cfg: RowConfig, index_type: str | None = None) -> str:
    types = ctype if index_type is None else f"{ctype}, {index_type}"
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    if cfg.cluster > 1:
        return f"{name}_cluster<{types}, {cfg.tpr}, {cfg.vpt}, {cfg.cluster}{min_blocks}>"
    return f"{name}<{types}, {cfg.tpr}, {cfg.rows}, {cfg.vpt}{min_blocks}>"


def softmax_kernel(direction: str, ctype: str, cfg: RowConfig) -> str:
    return _row_kernel(f"softmax_{direction}", ctype, cfg)


def staged_kernel(direction: str, ctype: str, cfg: StagedConfig) -> str:
    if cfg.cluster > 1:
        return f"softmax_{direction}_staged_cluster<{ctype}, {cfg.tpr}, {cfg.cluster}>"
    return f"softmax_{direction}_staged<{ctype}, {cfg.tpr}, {cfg.rows}>"


def split_kernel(direction: str, ctype: str, cfg: SplitConfig) -> str:
    return f"softmax_{direction}_split<{ctype}, {cfg.threads}, {cfg.vpt}>"


def ce_fwd_kernel(ctype: str, index_type: str, grad: bool, softcap: bool, cfg: RowConfig) -> str:
    """The cross-entropy forward for targets of `index_type`; with `grad` it writes the gradient too, with `softcap`
    it caps the logits."""
    flags = ", ".join("true" if flag else "false" for flag in (grad, softcap))
    return _row_kernel("ce_fwd", ctype, cfg, f"{index_type}, {flags}")


def ce_probs_fwd_kernel(ctype: str, grad: bool, softcap: bool, cfg: RowConfig) -> str:
    """The cross-entropy forward for class-probability targets; with `grad` it writes the gradient too, with
    `softcap` it caps the logits."""
    flags = ", ".join("true" if flag else "false" for flag in (grad, softcap))
    return _row_kernel("ce_probs_fwd", ctype, cfg, flags)


def ce_scale_kernel(ctype: str, cfg: RowConfig) -> str:
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    return f"ce_scale<{ctype}, {cfg.tpr}, {cfg.vpt}{min_blocks}>"


def ce_gradient_kernel(ctype: str, index_type: str, softcap: bool, cfg: RowConfig) -> str:
    """The gradient of a slice of the classes (vocabulary-parallel) for targets of `index_type`; with `softcap` it
    caps the logits."""
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    cap = "true" if softcap else "false"
    return f"ce_gradient<{ctype}, {index_type}, {cap}, {cfg.tpr}, {cfg.vpt}{min_blocks}>"


def lp_fwd_kernel(ctype: str, softcap: bool, cfg: RowConfig) -> str:
    """The log-probabilities forward (row statistics); with `softcap` it caps the logits."""
    return _row_kernel("lp_fwd", ctype, cfg, "true" if softcap else "false")


def lp_bwd_kernel(ctype: str, index_type: str, softcap: bool, cfg: RowConfig) -> str:
    """The log-probabilities backward for ids of `index_type`; with `softcap` it caps the logits."""
    min_blocks = f", {cfg.min_blocks}" if cfg.min_blocks else ""
    cap = "true" if softcap else "false"
    return f"lp_bwd<{ctype}, {index_type}, {cap}, {cfg.tpr}, {cfg.vpt}{min_blocks}>"


def blocksparse_kernel(direction: str, ctype: str, cfg: RowConfig) -> str:
    """A register kernel: the forward a warp a row, the backward its lanes a row taken at launch."""
    return _row_kernel(f"bs_{direction}", ctype, cfg)


def blocksparse_staged_kernel(ctype: str, cfg: BlockSparseStaged) -> str:
    """The staged forward, its lanes a row compiled as a constant (LOG2LANES)."""
    return f"bs_fwd_staged<{ctype}, {cfg.warps}, {cfg.cap}, {cfg.lanes.bit_length() - 1}>"


def _softmax_rows(ctype: str, cc: int) -> list[str]:
    rule_configs = [cfg for *_, cfg in _tuning.SOFTMAX_RULES]
    configs = dict.fromkeys(_tuning.usable(_tuning.SOFTMAX_CONFIGS + tuple(rule_configs), cc))
    return [softmax_kernel(d, ctype, c) for d in _DIRECTIONS for c in configs]


def _softmax_staged(ctype: str, cc: int) -> list[str]:
    clusters = [c for c in _tuning.STAGED_CLUSTERS if c == 1 or cc >= _tuning.CLUSTER_MIN_CC]
    names = []
    for d in _DIRECTIONS:
        configs = [StagedConfig(_tuning.STAGED_BLOCK_THREADS[d], 1, c, 0) for c in clusters]
        configs.append(StagedConfig(32, _tuning.STAGED_WARP_ROWS, 1, 0))
        names += [staged_kernel(d, ctype, c) for c in configs]
    return names


def _softmax_split(ctype: str) -> list[str]:
    shapes = dict.fromkeys((d, t, v) for d in _DIRECTIONS for t, v in _tuning.SPLIT_CHOICES[d])
    return [split_kernel(d, ctype, SplitConfig(t, v, 0)) for d, t, v in shapes]


def _cross_entropy(ctype: str, cc: int) -> list[str]:
    configs = _tuning.usable(_tuning.CE_FWD_CONFIGS, cc)
    flags = list(itertools.product((False, True), repeat=2))
    forward = [ce_fwd_kernel(ctype, i, grad, cap, c) for i in INDEX_TYPES for grad, cap in flags for c in configs]
    gradient = [ce_gradient_kernel(ctype, i, cap, _tuning.CE_GRADIENT_CONFIG) for i in INDEX_TYPES
                for cap in (False, True)]
    probabilities = [ce_probs_fwd_kernel(ctype, grad, cap, c) for grad, cap in flags for c in configs]
    return forward + probabilities + [ce_scale_kernel(ctype, _tuning.CE_SCALE_CONFIG)] + gradient


def _blocksparse(ctype: str) -> list[str]:
    registers = [blocksparse_kernel(d, ctype, c) for d in _DIRECTIONS for c in _tuning.BLOCKSPARSE_CONFIGS]
    staged = [blocksparse_staged_kernel(ctype, BlockSparseStaged(_tuning.BLOCKSPARSE_STAGED_WARPS, cap, lanes))
              for cap in _tuning.BLOCKSPARSE_STAGED_CAPS for lanes in _tuning.BLOCKSPARSE_LANE_COUNTS]
    return registers + staged


def _log_probs(ctype: str) -> list[str]:
    forward = [lp_fwd_kernel(ctype, cap, c) for cap in (False, True) for c in _tuning.LP_FWD_CONFIGS]
    backward = [lp_bwd_kernel(ctype, i, cap, _tuning.LP_BWD_CONFIG) for i in INDEX_TYPES for cap in (False, True)]
    return forward + backward


def expressions(source: str, ctype: str, cc: int) -> tuple[str, ...]:
    """Every name expression of `source` for element type `ctype` on compute capability `cc` (e.g. 90)."""
    if source == SOFTMAX_ROWS_SOURCE:
        names = _softmax_rows(ctype, cc)
    elif source == SOFTMAX_STAGED_SOURCE:
        names = _softmax_staged(ctype, cc)
    elif source == SOFTMAX_SPLIT_SOURCE:
        names = _softmax_split(ctype)
    elif source == CROSS_ENTROPY_SOURCE:
        names = _cross_entropy(ctype, cc)
    elif source == BLOCKSPARSE_SOURCE:
        names = _blocksparse(ctype)
    elif source == LOG_PROBS_SOURCE:
        names = _log_probs(ctype)
    else:
        raise ValueError(f"unknown source {source!r}")
    return tuple(dict.fromkeys(names))
