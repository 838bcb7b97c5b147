"""Which kernel instantiations exist and which one a call uses; imports no CUDA framework.

The NVRTC compile test (tests/test_cuda_sources_compile.py) builds exactly the
name expressions listed here, so every launchable kernel is compiled in CI.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
SOURCES = ("softmax.cu", "cross_entropy.cu", "blocksparse.cu")
HEADERS = ("common.cuh",)
CUDA_TYPES = ("float", "f16_t", "bf16_t")
INDEX_TYPES = ("int", "long long")
OPTIONS = ("--std=c++17", f"-I{PACKAGE_DIR}")
CLUSTER_MIN_CC = 90  # thread-block clusters: sm_90 and newer
MAX_GRID = 2**31 - 1


class RowConfig(NamedTuple):
    """TPR threads per row group, ROWS row groups per block, VPT 16-byte vectors per thread, CLUSTER blocks per row."""

    tpr: int
    rows: int
    vpt: int
    cluster: int = 1

    @property
    def threads(self) -> int:
        return self.tpr * self.rows

    def capacity(self, elem_size: int) -> int:
        """Columns one pass holds in registers."""
        return self.tpr * self.vpt * (16 // elem_size) * self.cluster


SOFTMAX_CONFIGS = (
    RowConfig(32, 4, 1), RowConfig(32, 4, 2), RowConfig(32, 4, 4), RowConfig(32, 4, 8),
    RowConfig(256, 1, 2), RowConfig(256, 1, 4), RowConfig(512, 1, 4), RowConfig(1024, 1, 4),
    RowConfig(1024, 1, 8),
    RowConfig(1024, 1, 4, 2), RowConfig(1024, 1, 4, 4), RowConfig(1024, 1, 4, 8),
    RowConfig(1024, 1, 8, 2), RowConfig(1024, 1, 8, 4), RowConfig(1024, 1, 8, 8),
    RowConfig(512, 1, 4, 2), RowConfig(512, 1, 4, 4), RowConfig(512, 1, 4, 8),
    RowConfig(512, 1, 8, 2), RowConfig(512, 1, 8, 4), RowConfig(512, 1, 8, 8),
)
CE_FWD_CONFIGS = (
    RowConfig(32, 4, 2), RowConfig(256, 1, 4), RowConfig(256, 1, 4, 4), RowConfig(256, 1, 4, 8),
)
CE_BWD_CONFIG = RowConfig(256, 1, 4)
BLOCKSPARSE_CONFIGS = (RowConfig(32, 4, 1), RowConfig(32, 4, 4), RowConfig(128, 1, 4), RowConfig(512, 1, 4))


def _row_kernel(name: str, ctype: str, cfg: RowConfig, index_type: str | None = None) -> str:
    types = ctype if index_type is None else f"{ctype}, {index_type}"
    if cfg.cluster > 1:
        return f"{name}_cluster<{types}, {cfg.tpr}, {cfg.vpt}, {cfg.cluster}>"
    return f"{name}<{types}, {cfg.tpr}, {cfg.rows}, {cfg.vpt}>"


def softmax_kernel(direction: str, ctype: str, cfg: RowConfig) -> str:
    return _row_kernel(f"softmax_{direction}", ctype, cfg)


def ce_fwd_kernel(ctype: str, index_type: str, cfg: RowConfig) -> str:
    return _row_kernel("ce_fwd", ctype, cfg, index_type)


def ce_bwd_kernel(ctype: str, index_type: str) -> str:
    return f"ce_bwd<{ctype}, {index_type}, {CE_BWD_CONFIG.tpr}, {CE_BWD_CONFIG.vpt}>"


def blocksparse_kernel(direction: str, ctype: str, cfg: RowConfig) -> str:
    return _row_kernel(f"bs_{direction}", ctype, cfg)


def _usable(configs, cc: int):
    return [c for c in configs if c.cluster == 1 or cc >= CLUSTER_MIN_CC]


def expressions(source: str, ctype: str, cc: int) -> tuple[str, ...]:
    """Every name expression of `source` for element type `ctype` on compute capability `cc` (e.g. 90)."""
    if source == "softmax.cu":
        return tuple(softmax_kernel(d, ctype, c) for d in ("fwd", "bwd") for c in _usable(SOFTMAX_CONFIGS, cc))
    if source == "cross_entropy.cu":
        fwd = [ce_fwd_kernel(ctype, i, c) for i in INDEX_TYPES for c in _usable(CE_FWD_CONFIGS, cc)]
        return tuple(fwd + [ce_bwd_kernel(ctype, i) for i in INDEX_TYPES])
    if source == "blocksparse.cu":
        return tuple(blocksparse_kernel(d, ctype, c) for d in ("fwd", "bwd") for c in BLOCKSPARSE_CONFIGS)
    raise ValueError(f"unknown source {source!r}")


def _smallest_fitting(configs, columns: int, elem_size: int):
    for cfg in configs:
        if cfg.capacity(elem_size) >= columns:
            return cfg
    return configs[-1]


def _half_forward_config(columns: int, cc: int) -> RowConfig:
    """16-bit forward. Measured on an H200: warps, or 512-thread blocks (two per multiprocessor)
    over two register tiles, beat one pass of 1024-thread blocks."""
    if columns <= 1024:
        return _smallest_fitting((RowConfig(32, 4, 1), RowConfig(32, 4, 2), RowConfig(32, 4, 4)), columns, 2)
    if columns <= 4096:
        return RowConfig(32, 4, 4)
    if columns <= 8192:
        return RowConfig(256, 1, 4)
    if columns <= 32768 or cc < CLUSTER_MIN_CC:
        return RowConfig(512, 1, 4)
    for cluster in (2, 4, 8):
        cfg = RowConfig(512, 1, 4, cluster)
        if 2 * cfg.capacity(2) >= columns:
            return cfg
    return RowConfig(512, 1, 4, 8)


def softmax_config(direction: str, columns: int, elem_size: int, cc: int) -> RowConfig:
    """Mostly the smallest configuration that holds the row in registers (the widest loops over tiles)."""
    if direction == "fwd" and elem_size == 2:
        return _half_forward_config(columns, cc)
    if direction == "bwd" and elem_size == 2 and 512 < columns <= 1024:
        return RowConfig(32, 4, 2)  # measured: two tiles per warp beat one
    usable = _usable(SOFTMAX_CONFIGS, cc)
    # 16-byte vectors per thread that stay in registers without spilling at 1024 threads
    budget = 8 if direction == "fwd" and elem_size == 4 else 4
    ordered = sorted((c for c in usable if c.vpt <= budget),
                     key=lambda c: (c.capacity(elem_size), c.cluster, -c.tpr))
    return _smallest_fitting(ordered, columns, elem_size)


def ce_fwd_config(rows: int, classes: int, elem_size: int, cc: int, sm_count: int) -> RowConfig:
    """A warp per short row; a 256-thread block per row; a cluster per row when rows are too few to fill the GPU."""
    if classes <= CE_FWD_CONFIGS[0].capacity(elem_size):
        return CE_FWD_CONFIGS[0]
    tiles = -(-classes // CE_FWD_CONFIGS[1].capacity(elem_size))
    if cc < CLUSTER_MIN_CC or rows >= 2 * sm_count or tiles < 8:
        return CE_FWD_CONFIGS[1]
    return CE_FWD_CONFIGS[2] if rows >= sm_count // 2 else CE_FWD_CONFIGS[3]


def blocksparse_config(row_length: int, elem_size: int) -> RowConfig:
    return _smallest_fitting(BLOCKSPARSE_CONFIGS, row_length, elem_size)


def grid_blocks(rows: int, cfg: RowConfig) -> int:
    """Blocks for a row-loop kernel: one row group per row, capped at the grid limit."""
    blocks = -(-rows // cfg.rows) * cfg.cluster
    return min(blocks, MAX_GRID // cfg.cluster * cfg.cluster)
