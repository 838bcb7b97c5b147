"""CuPy backend: its choices of kernel and its launches (run anywhere), and its kernels on a GPU (skip without
CUDA + cupy).

The kernels are called directly through the backend contract, against the float64
references of multisoft/check.py at its tolerances (cross-entropy: tests/harness.py's
cross_entropy_contract), so these tests do not depend on
the front's dispatch (only on its look-up table for the block-sparse kernels). The
GPU tests force each kernel path by patching multisoft_cupy._tuning (cross-entropy's forward configurations: the
paths of tests/kernel_paths.py, on which tests/test_contract.py checks the contract too).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import multisoft_cupy
from harness import assert_close, assert_row_stats, cross_entropy_contract, row_stats_contract
from kernel_paths import force, forced_paths
from multisoft import LossOptions
from multisoft._blocksparse import lookup_table  # (the front's look-up table: torch only, no backend)
from multisoft.check import (
    reference_blocksparse, reference_blocksparse_backward, reference_slice_gradient, reference_softmax,
    reference_softmax_backward, softmax_backward_magnitude)
from multisoft_cupy import _instances, _tuning  # (import no CUDA framework)

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
RULE_CONFIGS = tuple(dict.fromkeys(cfg for *_, cfg in _tuning.SOFTMAX_RULES))
SPLIT_SHAPES = tuple(dict.fromkeys(shape for choices in _tuning.SPLIT_CHOICES.values() for shape in choices))


def random_layout(heads, mb, nb, generator=None, empty_row=True):
    layout = (torch.rand(heads, mb, nb, generator=generator) < 0.4).long()
    layout[:, :, 0] = 1
    if empty_row and mb > 1:
        layout[0, 1] = 0  # a block-row without blocks
    return layout


# ---- no GPU needed ----

def test_version_is_installed_distribution_or_none():
    v = multisoft_cupy.version()
    assert v is None or v[0].isdigit()
    if importlib.util.find_spec("cupy") is None:
        reason = multisoft_cupy.unavailable_reason(torch.device("cuda", 0), torch.float32)
        assert reason is not None


def test_description_names():
    assert multisoft_cupy.DTYPES == (torch.float32, torch.float16, torch.bfloat16)
    assert multisoft_cupy.simulated() is False
    reason = multisoft_cupy.unavailable_reason(torch.device("cuda", 0), torch.float64)
    assert reason == "no CuPy kernels for torch.float64"


@pytest.mark.parametrize("elem", [4, 2])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("cc", [80, 90])
def test_softmax_config_is_compiled_and_loops_little(direction, cc, elem):
    widest = max(c.capacity(elem) for c in _tuning.usable(_tuning.SOFTMAX_CONFIGS, cc))
    expressions = _instances.expressions(_instances.SOFTMAX_ROWS_SOURCE, "float", cc)
    for cols in (1, 7, 128, 256, 512, 1000, 1024, 4096, 5000, 32768, 131072, 262144, 1 << 20):
        cfg = _tuning.softmax_config(direction, cols, elem, cc)
        assert cfg in _tuning.SOFTMAX_CONFIGS + RULE_CONFIGS
        assert 4 * cfg.capacity(elem) >= min(cols, widest), (cols, cfg)
        assert cc >= 90 or cfg.cluster == 1
        assert _instances.softmax_kernel(direction, "float", cfg) in expressions


@pytest.mark.parametrize("elem", [4, 2])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("cc", [80, 90])
def test_staged_config_covers_the_row_in_compiled_kernels(direction, cc, elem, monkeypatch):
    monkeypatch.setattr(_tuning, "STAGED_BLOCK_COLUMNS", {(direction, elem): (999, math.inf)})
    monkeypatch.setattr(_tuning, "STAGED_WARP_COLUMNS", {})
    assert _tuning.staged_config(direction, 999, elem, cc, 227 * 1024) is None
    assert _tuning.staged_config(direction, 1000, elem, 75, 227 * 1024) is None
    expressions = _instances.expressions(_instances.SOFTMAX_STAGED_SOURCE, "float", cc)
    most = max(_tuning.STAGED_CLUSTERS) if cc >= 90 else 1
    vec = 16 // elem
    for cols in (1000, 1008, 65536, 131072, 262144 + 24, 1 << 20):
        for max_shared in (32 * 1024, 99 * 1024, 227 * 1024):
            cfg = _tuning.staged_config(direction, cols, elem, cc, max_shared)
            if cfg is None:  # no slice small enough: the register kernels take the row
                smallest = _tuning.StagedConfig(512, 1, most, -(-cols // most // vec) * vec)
                assert smallest.shared_bytes(direction, elem) > min(max_shared, _tuning.STAGED_BLOCK_BYTES)
                continue
            assert cfg.slice % vec == 0 and cfg.cluster * cfg.slice >= cols > (cfg.cluster - 1) * cfg.slice
            assert cfg.shared_bytes(direction, elem) <= min(max_shared, _tuning.STAGED_BLOCK_BYTES)
            assert cfg.cluster <= most and cfg.rows == 1
            assert cfg.threads == _tuning.STAGED_BLOCK_THREADS[direction]
            assert _instances.staged_kernel(direction, "float", cfg) in expressions
            for rows in (1, 7, 1024, 1 << 31):
                grid = _tuning.staged_grid(rows, cfg)
                assert grid % cfg.cluster == 0 and 0 < grid <= min(rows * cfg.cluster, _tuning.MAX_GRID)


@pytest.mark.parametrize("elem", [4, 2])
def test_staged_warps_take_their_column_range(elem, monkeypatch):
    monkeypatch.setattr(_tuning, "STAGED_WARP_COLUMNS", {("fwd", elem): (512, 2048)})
    monkeypatch.setattr(_tuning, "STAGED_BLOCK_COLUMNS", {("fwd", elem): (8191, math.inf)})
    assert _tuning.staged_config("fwd", 512, elem, 90, 227 * 1024) is None
    assert _tuning.staged_config("bwd", 1024, elem, 90, 227 * 1024) is None
    expressions = _instances.expressions(_instances.SOFTMAX_STAGED_SOURCE, "bf16_t", 80)
    for cols in (513, 1024, 2048):
        cfg = _tuning.staged_config("fwd", cols, elem, 80, 227 * 1024)
        assert (cfg.tpr, cfg.rows, cfg.cluster) == (32, _tuning.STAGED_WARP_ROWS, 1) and cfg.slice >= cols
        assert _instances.staged_kernel("fwd", "bf16_t", cfg) in expressions
        assert _tuning.staged_grid(100, cfg) == -(-100 // cfg.rows)
    assert _tuning.staged_config("fwd", 2049, elem, 90, 227 * 1024) is None
    too_large = _tuning.STAGED_WARP_ROWS * 2048 * elem - 1
    monkeypatch.setattr(_tuning, "STAGED_BLOCK_BYTES", too_large)
    assert _tuning.staged_config("fwd", 2048, elem, 90, 227 * 1024) is None
    assert _tuning.staged_config("fwd", 8192, elem, 90, 227 * 1024).tpr > 32


def test_split_config_keeps_a_row_within_the_gpu(monkeypatch):
    """Split only from SPLIT_MIN_COLUMNS on, sm_80+, with no more chunks per row than multiprocessors; otherwise
    None (the caller then stages or uses registers). The first SPLIT_CHOICES entry that fits is taken."""
    expressions = set(_instances.expressions(_instances.SOFTMAX_SPLIT_SOURCE, "float", 90))
    for direction, elem in _tuning.SPLIT_MIN_COLUMNS:
        low = _tuning.SPLIT_MIN_COLUMNS[(direction, elem)]
        assert _tuning.split_config(direction, 8, low - 1, elem, 90, 132) is None
        assert _tuning.split_config(direction, 8, low, elem, 75, 132) is None
        for cols in (low, 262144, 1 << 20, 1 << 23):
            cfg = _tuning.split_config(direction, 8, cols, elem, 90, 132)
            if cfg is None:
                assert all(-(-cols // (t * v * 16 // elem)) > 132 for t, v in _tuning.SPLIT_CHOICES[direction])
                continue
            assert -(-cols // cfg.chunk) <= 132 and cfg.chunk == cfg.threads * cfg.vpt * (16 // elem)
            assert _instances.split_kernel(direction, "float", cfg) in expressions
        assert _tuning.split_config(direction, 2**31 // 8, 1 << 20, elem, 90, 132) is None
    monkeypatch.setitem(_tuning.SPLIT_CHOICES, "fwd", ((128, 4), (128, 8)))
    monkeypatch.setitem(_tuning.SPLIT_MIN_COLUMNS, ("fwd", 4), 1)
    assert _tuning.split_config("fwd", 8, 1 << 17, 4, 90, 132) == (128, 4, 2048)  # 64 chunks
    assert _tuning.split_config("fwd", 8, 1 << 17, 4, 90, 32) == (128, 8, 4096)  # 64 chunks do not fit, 32 do


def _kernel_parameters(source: str, name: str) -> list[str]:
    """C types of the parameters of kernel template `name` in `source`."""
    import re
    code = (_instances.PACKAGE_DIR / source).read_text()
    match = re.search(r"\)\s+" + name + r"\(([^)]*)\)", code)
    assert match, name
    return [" ".join(p.split()[:-1]) for p in match.group(1).split(",")]


_NUMPY_FOR_C = {"i64": "int64", "int": "int32", "float": "float32"}


def test_launch_arguments_match_kernel_signatures(monkeypatch):
    """RawKernel checks nothing: every argument's numpy type must match the C parameter, on every kernel path."""
    import types

    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    from multisoft_cupy import _launch, blocksparse, cross_entropy, softmax

    calls = []
    monkeypatch.setattr(_launch, "launch",
                        lambda t, src, expr, grid, block, args, shared_mem=0: calls.append((src, expr, args)))
    for mod in (softmax, cross_entropy, blocksparse):
        monkeypatch.setattr(mod, "launch", _launch.launch, raising=True)
        monkeypatch.setattr(mod, "device_info", lambda index: (90, 132))
        monkeypatch.setattr(mod, "device_index", lambda t: 0)
    monkeypatch.setattr(softmax, "shared_memory", lambda index: 227 * 1024)
    x = torch.randn(4, 300)
    softmax.forward(x, torch.empty_like(x), True)
    softmax.backward(x, x, torch.empty_like(x), False)
    monkeypatch.setattr(_tuning, "STAGED_BLOCK_COLUMNS", {("fwd", 4): (255, math.inf), ("bwd", 4): (255, math.inf)})
    for cluster in (1, 2):
        monkeypatch.setattr(_tuning, "STAGED_CLUSTERS", (cluster,))
        softmax.forward(x, torch.empty_like(x), True)
        softmax.backward(x, x, torch.empty_like(x), False)
    monkeypatch.setattr(_tuning, "SPLIT_MIN_COLUMNS", {("fwd", 4): 256, ("bwd", 4): 256})
    softmax.forward(x, torch.empty_like(x), True)
    softmax.backward(x, x, torch.empty_like(x), False)
    assert [(src, expr.split("<")[0]) for src, expr, _ in calls] == [
        ("softmax_rows.cu", "softmax_fwd"), ("softmax_rows.cu", "softmax_bwd"),
        ("softmax_staged.cu", "softmax_fwd_staged"), ("softmax_staged.cu", "softmax_bwd_staged"),
        ("softmax_staged.cu", "softmax_fwd_staged_cluster"), ("softmax_staged.cu", "softmax_bwd_staged_cluster"),
        ("softmax_split.cu", "softmax_fwd_split"), ("softmax_split.cu", "softmax_bwd_split")]
    target = torch.zeros(4, dtype=torch.int64)
    w = torch.ones(300)
    stats = (torch.empty(4), torch.empty(4), torch.empty(4))
    smoothed = LossOptions(ignore_index=-100, label_smoothing=0.1, softcap=0.0, lse_square_scale=0.0)
    cross_entropy.forward(x, target, w, *stats, None, None, smoothed)
    narrow = x[:, :100].contiguous()  # a warp a row
    cross_entropy.forward(narrow, target.int(), None, *stats, narrow, torch.ones(1).expand(4),
                          LossOptions(ignore_index=-100, label_smoothing=0.0, softcap=30.0, lse_square_scale=1e-4))
    cross_entropy.scale(x, torch.ones(1))
    cross_entropy.scale(x, torch.ones(4))
    cross_entropy.forward(narrow, target, w[:100], *stats, None, None, smoothed, row_stats=torch.empty(3, 4))
    cross_entropy.gradient(x, target, w, torch.ones(2, 4), torch.ones(3, 4), x, LossOptions(softcap=0.0))
    cross_entropy.gradient(narrow, target.int(), None, torch.ones(2, 4), torch.ones(3, 4), torch.empty_like(narrow),
                           LossOptions(softcap=2.0))
    monkeypatch.setattr(_tuning, "ce_fwd_config", lambda *args: _tuning.CE_FWD_CLUSTERS[0])
    cross_entropy.forward(x, target, w, *stats, torch.empty_like(x), torch.ones(4), smoothed._replace(softcap=1e39))
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    lut = lookup_table(layout, 16, "cpu")
    storage = torch.randn(lut.nnz * 256 + 1)
    for xb in (storage[:-1].view(1, lut.nnz, 16, 16), storage[1:].view(1, lut.nnz, 16, 16)):  # aligned, not
        blocksparse.forward(xb, torch.empty_like(xb), lut, 1.0, True)
        blocksparse.backward(xb, xb, torch.empty_like(xb), lut, 1.0)
    assert [expr for _, expr, _ in calls[8:16]] == [
        "ce_fwd<float, long long, false, false, 256, 1, 4>", "ce_fwd<float, int, true, true, 32, 4, 2>",
        "ce_scale<float, 256, 4, 4>", "ce_scale<float, 256, 4, 4>", "ce_fwd<float, long long, false, false, 32, 4, 2>",
        "ce_gradient<float, long long, false, 256, 4, 4>", "ce_gradient<float, int, true, 256, 4, 4>",
        "ce_fwd_cluster<float, long long, true, false, 256, 4, 4>"]  # a softcap beyond float32: none
    # the forward's row_stats pointer: null unless asked for
    assert [bool(args[9]) for _, expr, args in calls[8:16] if expr.startswith("ce_fwd")] == [False, False, True, False]
    assert [expr.split("<")[0] for _, expr, _ in calls[16:]] == ["bs_fwd_staged", "bs_bwd", "bs_fwd", "bs_bwd"]
    for source, expression, args in calls:
        params = _kernel_parameters(source, expression.split("<")[0])
        assert len(params) == len(args), expression
        for param, arg in zip(params, args):
            expected = "uint64" if param.endswith("*") else _NUMPY_FOR_C[param.replace("const ", "")]
            assert type(arg).__name__ == expected, (expression, param, type(arg))


def test_launch_opts_in_to_its_dynamic_shared_memory_once(monkeypatch):
    """A kernel's dynamic shared memory is opted in to (48 KB less its static shared memory is all it gets
    without): set once per device and kernel for the largest size asked (again after clear_cache reloads the
    modules), 48 KB included, never for a launch without dynamic shared memory; every launch gets its bytes."""
    import contextlib
    import types

    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    from multisoft_cupy import _launch

    class Kernel:
        def __init__(self):
            self.opt_ins, self.shared = [], []

        max_dynamic_shared_size_bytes = property(None, lambda self, size: self.opt_ins.append(size))

        def __call__(self, grid, block, args, shared_mem=0):
            self.shared.append(shared_mem)

    kernels = {}
    monkeypatch.setattr(_launch, "kernel",
                        lambda index, src, element, expr: kernels.setdefault((index, expr), Kernel()))
    monkeypatch.setattr(_launch, "cupy", SimpleNamespace(cuda=SimpleNamespace(Device=contextlib.nullcontext)))
    monkeypatch.setattr(_launch, "_stream", contextlib.nullcontext)
    monkeypatch.setattr(_launch, "device_index", lambda t: t.numel())  # a tensor of n elements: device n
    monkeypatch.setattr(_launch, "_shared_set", {})
    kb = 1024
    source = _instances.SOFTMAX_STAGED_SOURCE
    for device, expr, size in ((1, "a", 64 * kb), (1, "a", 64 * kb), (1, "b", 48 * kb), (1, "a", 32 * kb),
                               (1, "a", 100 * kb), (2, "a", 64 * kb), (1, "c", 0)):
        _launch.launch(torch.empty(device), source, expr, (1, 1, 1), (32, 1, 1), (), shared_mem=size)
    assert kernels[(1, "a")].opt_ins == [64 * kb, 100 * kb] and kernels[(2, "a")].opt_ins == [64 * kb]
    assert kernels[(1, "b")].opt_ins == [48 * kb] and kernels[(1, "c")].opt_ins == []
    assert kernels[(1, "a")].shared == [64 * kb, 64 * kb, 32 * kb, 100 * kb]
    _launch.clear_cache()
    _launch.launch(torch.empty(1), source, "a", (1, 1, 1), (32, 1, 1), (), shared_mem=64 * kb)
    assert kernels[(1, "a")].opt_ins == [64 * kb, 100 * kb, 64 * kb]


def test_blocksparse_forward_stages_every_layout():
    """Staged on sm_80+ for every layout, in the smallest compiled buffer that holds the longest row or
    BLOCKSPARSE_STAGED_MARGIN x the mean row if less, else the largest (longer rows are staged in parts)."""
    staged = _tuning.blocksparse_staged_config
    caps = _tuning.BLOCKSPARSE_STAGED_CAPS
    assert staged(1024, 1200, 2, 90, 64).cap == 256  # 1200 16-bit elements: 150 vectors
    assert staged(1024, 2080, 2, 90, 64).cap == 256  # 1.25 x 1024 elements, not the longest row's 2080
    assert staged(1024, 2080, 2, 80, 64).cap == 256
    assert staged(640, 672, 2, 90, 64).cap == 128  # the longest row: 84 vectors
    assert staged(640, 672, 4, 90, 64).cap == 256  # float32: 168 vectors
    assert staged(2048, 2300, 4, 90, 64).cap == 1024  # 575 float32 vectors
    assert staged(4096, 16384, 2, 90, 64).cap == caps[-1]  # 5120 elements: the largest buffer, rows in parts
    assert staged(8, 8, 2, 90, 64).cap == caps[0]  # the shortest rows too
    assert staged(1024, 1200, 2, 75, 64) is None  # no cp.async before sm_80
    cfg = staged(1024, 1200, 2, 90, 64)   # rows / (rows a block) blocks, rounded up, within the grid limit
    assert cfg.grid(4 * cfg.rows) == 4 and cfg.grid(4 * cfg.rows + 1) == 5
    assert cfg.grid(1 << 40) == _tuning.MAX_GRID


@pytest.mark.parametrize("lane_vectors", [4, 8])
def test_blocksparse_staged_lanes_per_row(lane_vectors, monkeypatch):
    """Lanes per row: the power of two nearest the mean row's 16-byte vectors over BLOCKSPARSE_STAGED_LANE_VECTORS,
    at most 32 and at least 32 / B, so that a warp's rows lie in one block-row; more where a block's buffers would
    pass STAGED_BLOCK_BYTES. A buffer per row, padded where fewer than 8 lanes would read the same banks, and shared
    memory for all of a block's rows."""
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STAGED_LANE_VECTORS", lane_vectors)
    lanes = _tuning.blocksparse_staged_lanes
    assert lanes(450, 64, 2) == (8 if lane_vectors == 8 else 16)  # 56.25 vectors: 7.0 or 14.1 a lane
    assert lanes(450, 64, 4) == (16 if lane_vectors == 8 else 32)
    assert lanes(1 << 20, 64, 2) == 32
    assert lanes(8, 4, 2) == 8 and lanes(8, 64, 2) == 1  # no more rows a warp than a block-row has
    for block in (4, 16, 32, 64, 128):
        for elem in (2, 4):
            for mean, longest in ((256, 300), (450, 1100), (1024, 1200), (2048, 4096), (8192, 8192)):
                cfg = _tuning.blocksparse_staged_config(mean, longest, elem, 90, block)
                assert 32 % cfg.lanes == 0 and block % (32 // cfg.lanes) == 0
                assert cfg.lanes >= lanes(mean, block, elem) and cfg.rows == cfg.warps * 32 // cfg.lanes
                assert cfg.row_stride == cfg.cap + (cfg.lanes if cfg.lanes < 8 else 0)
                assert cfg.shared_bytes == cfg.rows * cfg.row_stride * 16
                assert cfg.shared_bytes <= _tuning.STAGED_BLOCK_BYTES or cfg.lanes == 32


def test_blocksparse_backward_lanes_per_row():
    """The backward's lanes per row: the power of two nearest the mean row's bytes over
    BLOCKSPARSE_BACKWARD_LANE_BYTES (64), at most 32, at least a block's row of vectors and 32 / B."""
    lanes = _tuning.blocksparse_backward_lanes
    assert _tuning.BLOCKSPARSE_BACKWARD_LANE_BYTES == 64
    assert lanes(450, 64, 2) == 16 and lanes(450, 64, 4) == 32   # 900 bytes: 14.1; 1800: 28.1
    assert lanes(16, 16, 2) == 2 and lanes(16, 16, 4) == 4       # a block's row: 2 or 4 vectors
    assert lanes(128, 128, 2) == 16 and lanes(1 << 20, 16, 2) == 32
    for block in (16, 32, 64, 128):
        for elem in (2, 4):
            for mean in (16, 100, 450, 1024, 8192):
                n = lanes(mean, block, elem)
                assert 32 % n == 0 and block % (32 // n) == 0 and n >= block * elem // 16


def test_blocksparse_values_per_thread_follow_the_mean_row():
    """The first choice whose warp tile holds the layout's mean row: float32 backward rows of 1040 elements on
    average take 64 values per thread (32 hold 1024), rows of 467 take 32; a single choice is always taken."""
    assert _tuning.BLOCKSPARSE_BACKWARD_FLOATS[4] == (32, 64)
    assert _tuning.blocksparse_floats((32, 64), 1040.0) == 64
    assert _tuning.blocksparse_floats((32, 64), 467.0) == 32
    assert _tuning.blocksparse_floats((32, 64), 1 << 20) == 64
    assert _tuning.blocksparse_floats((32,), 1 << 20) == 32
    assert _tuning.blocksparse_config(1280, 4, 64).vpt == 16 and _tuning.blocksparse_config(1280, 4, 32).vpt == 8
    assert _tuning.blocksparse_register_config("bwd", 1040.0, 4).vpt == 16  # 64 values: 16 float32 vectors
    assert _tuning.blocksparse_register_config("fwd", 1040.0, 4).vpt == 8  # the forward holds 32
    # bf16 rows of 1059 elements on average: 40 values per thread, a tile of 5 vectors (1280 elements)
    assert _tuning.blocksparse_floats((40, 64), 1059.0) == 40 and _tuning.blocksparse_config(1059.0, 2, 40).vpt == 5
    assert _tuning.blocksparse_config(465.0, 2, 40).vpt == 2  # the tile holds the mean row, not the longest
    # 8 lanes a row: the tile is chosen for the mean row as a warp's share (4 x 265 elements) would hold it
    assert _tuning.blocksparse_register_config("bwd", 265.0, 2, 8) == _tuning.blocksparse_config(1060.0, 2, 40)


def test_rules_pick_their_config_only_in_range(monkeypatch):
    ruled = _tuning.RowConfig(32, 4, 4, 1, 8)
    clustered = _tuning.RowConfig(512, 1, 4, 8)
    monkeypatch.setattr(_tuning, "SOFTMAX_RULES", (("fwd", 2, 512, 1024, ruled), ("bwd", 2, 0, 1 << 20, clustered)))
    assert _tuning.softmax_config("fwd", 1024, 2, 90) == ruled
    assert _tuning.softmax_config("fwd", 512, 2, 90) != ruled
    assert _tuning.softmax_config("fwd", 1024, 4, 90) != ruled
    assert _tuning.softmax_config("bwd", 131072, 2, 90) == clustered
    assert _tuning.softmax_config("bwd", 131072, 2, 80).cluster == 1  # no clusters before sm_90


def test_heuristics_leave_rule_only_configs_to_rules(monkeypatch):
    rule_only = set(RULE_CONFIGS) - set(_tuning.SOFTMAX_CONFIGS)
    assert rule_only
    monkeypatch.setattr(_tuning, "SOFTMAX_RULES", ())
    for direction in ("fwd", "bwd"):
        for elem in (4, 2):
            for cols in (1, 256, 1000, 1024, 2048, 4096, 16384, 32768, 131072, 262144):
                assert _tuning.softmax_config(direction, cols, elem, 90) not in rule_only


def test_cross_entropy_forward_config_by_shape():
    """A warp for rows one tile holds; a block per row (held to 4 blocks a multiprocessor in 16 bits); a cluster
    per row on sm_90 when rows are too few to fill the GPU."""
    assert _tuning.ce_fwd_config(8192, 256, 2, 90, 132) == _tuning.CE_FWD_WARP
    assert _tuning.ce_fwd_config(8192, 32000, 2, 90, 132) == _tuning.CE_FWD_BLOCK_16BIT
    assert _tuning.ce_fwd_config(8192, 32000, 4, 90, 132) == _tuning.CE_FWD_BLOCK
    assert _tuning.ce_fwd_config(100, 262144, 2, 90, 132) == _tuning.CE_FWD_CLUSTERS[0]
    assert _tuning.ce_fwd_config(8, 262144, 2, 90, 132) == _tuning.CE_FWD_CLUSTERS[1]
    assert _tuning.ce_fwd_config(8, 262144, 2, 80, 132) == _tuning.CE_FWD_BLOCK_16BIT


def check_rows(softmax, x, dy, dtype, what, backward_by_terms=False) -> None:
    """softmax and log_softmax of `x`, forward and backward (with `dy`, at the float64 forward rounded to
    `dtype`, NaN rows as 0), through the backend's softmax module, against float64. The backward error is
    measured against |dx|, or with `backward_by_terms` against the size of dx's terms
    (multisoft.check.softmax_backward_magnitude)."""
    for log in (False, True):
        y = torch.empty_like(x)
        softmax.forward(x, y, log)
        ref = reference_softmax(x, -1, log)
        assert_close(y, ref, dtype, f"forward log={log} {what}")
        y = torch.where(ref.isnan(), 0.0, ref).to(dtype)
        dx = torch.empty_like(x)
        softmax.backward(y, dy, dx, log)
        magnitude = softmax_backward_magnitude(y, dy, -1, log) if backward_by_terms else None
        assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype, f"backward log={log} {what}", magnitude)


# ---- GPU ----

def _device(index=0):
    return torch.device("cuda", index)


def _kernels():
    from multisoft_cupy import blocksparse, cross_entropy, softmax
    return softmax, cross_entropy, blocksparse


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1), (5, 7), (4, 1000), (2, 4099), (3, 40000), (2, 262144 + 3)])
def test_softmax_matches_float64(shape, dtype):
    softmax, _, _ = _kernels()
    x = torch.randn(shape, device=_device()).mul(4).to(dtype)
    dy = torch.randn(shape, device=_device()).to(dtype)
    for log in (False, True):
        y = torch.empty_like(x)
        softmax.forward(x, y, log)
        assert_close(y, reference_softmax(x, -1, log), dtype, f"forward log={log}")
        dx = torch.empty_like(x)
        softmax.backward(y, dy, dx, log)
        assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype, f"backward log={log}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", ["block", "warp"])
@pytest.mark.parametrize("cluster", _tuning.STAGED_CLUSTERS)
def test_softmax_staged_rows_match_float64(cluster, group, dtype, monkeypatch):
    """Rows staged in shared memory, by a block (of each direction's threads, in clusters) or a warp: uneven and
    empty slices, blocks and clusters walking rows (a grid of one block or cluster), -inf entries, a row of -inf
    only (NaN, as torch), every direction and mode."""
    softmax, _, _ = _kernels()
    vec = 16 // dtype.itemsize
    if cluster > 1 and group == "warp":
        pytest.skip("a warp per row takes no cluster")
    if cluster > 1 and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("clusters need sm_90")
    cases = ((vec * 3, vec), (vec * (8 * 40 + 1), vec * 41), (vec * 1000, vec * 1000 // cluster),
             (vec * 37, vec * 37))
    for (cols, slice_), max_grid in itertools.product(cases, (cluster, 1 << 20)):
        configs = {d: (_tuning.StagedConfig(_tuning.STAGED_BLOCK_THREADS[d], 1, cluster, slice_) if group == "block"
                       else _tuning.StagedConfig(32, _tuning.STAGED_WARP_ROWS, 1, slice_)) for d in ("fwd", "bwd")}
        if cluster * slice_ < cols or any(c.shared_bytes(d, dtype.itemsize) > 160 * 1024 for d, c in configs.items()):
            continue
        monkeypatch.setattr(_tuning, "staged_config", lambda direction, *args: configs[direction])
        monkeypatch.setattr(_tuning, "MAX_GRID", max_grid)
        x = torch.randn(11, cols, device=_device()).mul(4).to(dtype)
        x[1, ::3] = float("-inf")
        x[3] = float("-inf")
        dy = torch.randn_like(x)
        check_rows(softmax, x, dy, dtype, f"cols={cols} grid<={max_grid}")


@gpu
@pytest.mark.parametrize("dtype,cols", [(torch.float32, 12288), (torch.bfloat16, 24576), (torch.bfloat16, 49152),
                                        (torch.bfloat16, 98304)])
def test_softmax_staged_rows_of_48_kilobytes(dtype, cols):
    """Rows whose staged slice takes exactly 48 KB of shared memory in one direction, as the tuning picks it: with
    the kernel's static shared memory that is past what a block gets without opting in (without it the launch
    fails with CUDA_ERROR_INVALID_VALUE)."""
    softmax, _, _ = _kernels()
    from multisoft_cupy import _launch

    index = torch.cuda.current_device()
    cc, _ = _launch.device_info(index)
    if cc < 90 and cols > 24576:
        pytest.skip("clusters need sm_90")
    sizes = {direction: cfg.shared_bytes(direction, dtype.itemsize) for direction in ("fwd", "bwd")
             if (cfg := _tuning.staged_config(direction, cols, dtype.itemsize, cc, _launch.shared_memory(index)))}
    assert 48 * 1024 in sizes.values(), f"no direction stages 48 KB at {cols} columns: {sizes}"
    x = torch.randn(5, cols, device=_device()).mul(4).to(dtype)
    check_rows(softmax, x, torch.randn_like(x), dtype, f"cols={cols}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads,vpt", SPLIT_SHAPES, ids=[f"t{t}-v{v}" for t, v in SPLIT_SHAPES])
@pytest.mark.parametrize("tail", [16, 3], ids=["vectors", "scalars"])
def test_softmax_split_rows_match_float64(tail, threads, vpt, dtype, monkeypatch):
    """Rows split over blocks that wait for each other: an uneven last chunk (of whole vectors, or not: scalar
    loads), a chunk of -inf only (in a row of values near -300), a row of -inf only (NaN, as torch), a NaN,
    as many chunks per row as multiprocessors over more rows than fit at once, every direction and mode."""
    softmax, _, _ = _kernels()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    chunk = threads * vpt * (16 // dtype.itemsize)
    cfg = _tuning.SplitConfig(threads, vpt, chunk)
    monkeypatch.setattr(_tuning, "split_config", lambda *args: cfg)
    for rows, chunks in ((11, 7), (40, sm_count)):
        cols = chunk * (chunks - 1) + tail
        x = torch.randn(rows, cols, device=_device()).mul(4).to(dtype)
        x[1] -= 300  # exp(0 - row max) would overflow: a chunk's -inf must not be rescaled from shift 0
        x[1, :chunk] = float("-inf")
        x[2, ::3] = float("-inf")
        x[3] = float("-inf")
        x[4, cols // 2] = float("nan")
        dy = torch.randn_like(x)
        # dx is a difference of terms, known to within float32 rounding of the terms' size (the error model of
        # multisoft.check): on rows of a million columns, log_softmax's exp(y) * sum(dy) reaches hundreds, so
        # where dy nearly cancels it, |dx| is far below the terms and its 1e-4 error is 0.6-2x rtol * |dx| but
        # 0.05x of the terms' tolerance.
        check_rows(softmax, x, dy, dtype, f"rows={rows} cols={cols} chunk={chunk}", backward_by_terms=True)


@gpu
def test_softmax_unaligned_rows_and_all_inf_row():
    softmax, _, _ = _kernels()
    base = torch.randn(3 * 4096 + 1, device=_device())
    x = base[1:].view(3, 4096)  # data pointer 4 bytes past a 16-byte boundary: scalar path
    x[1] = float("-inf")
    y = torch.empty_like(x)
    softmax.forward(x, y, False)
    assert y[1].isnan().all()
    assert_close(y[[0, 2]], reference_softmax(x[[0, 2]], -1, False), torch.float32, "unaligned")


@gpu
def test_non_default_stream_interleaved_with_torch_work():
    softmax, cross_entropy, _ = _kernels()
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=_device())
    with torch.cuda.stream(side):
        for _ in range(3):
            a = a @ a.T / 64  # long torch work queued before the kernels on the same stream
        x = a[:2048].contiguous()
        y = torch.empty_like(x)
        softmax.forward(x, y, True)
        z = y * 2  # torch reads the kernel's output on that stream
        target = torch.randint(0, 4096, (2048,), device=_device())
        loss = torch.empty(2048, device=_device())
        lse = torch.empty(2048, device=_device())
        grad = torch.empty_like(x)
        ones = torch.ones(1, device=_device())
        cross_entropy.forward(x, target, None, loss, lse, torch.empty_like(lse), grad, ones.expand(2048),
                              LossOptions(ignore_index=-100, label_smoothing=0.0, softcap=0.0, lse_square_scale=0.0))
        cross_entropy.scale(grad, ones * 3)  # the factor torch computes on that stream
        total = loss.sum()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    expected_loss, _, _, expected_grad, _ = cross_entropy_contract(x, target, grad_scale=torch.full((2048,), 3.0))
    assert_close(z, 2 * reference_softmax(x, -1, True), torch.float32, "stream softmax")
    assert_close(total, expected_loss.sum(), torch.float32, "stream loss")
    assert_close(grad, expected_grad, torch.float32, "stream gradient")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 64])
def test_blocksparse_causal_matches_float64(block, dtype):
    _, _, blocksparse = _kernels()
    g = torch.Generator().manual_seed(block)
    layout = random_layout(2, 5, 5, g)
    lut = lookup_table(layout, block, _device())
    x = torch.randn(3, lut.nnz, block, block, device=_device()).to(dtype)
    dy = torch.randn_like(x)
    for causal in (False, True):
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, 0.5, causal)
        assert_close(y, reference_blocksparse(x, layout, block, 0.5, causal), dtype, f"blocksparse causal={causal}")
        dx = torch.empty_like(x)
        blocksparse.backward(y, dy, dx, lut, 0.5)
        expected, _ = reference_blocksparse_backward(y, dy, layout, block, 0.5)
        assert_close(dx, expected, dtype, "blocksparse backward")


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device():
    softmax, cross_entropy, _ = _kernels()
    dev = _device(1)
    x = torch.randn(64, 5000, device=dev)
    y = torch.empty_like(x)
    with torch.cuda.device(0):  # the current device differs from the tensors'
        softmax.forward(x, y, False)
        target = torch.randint(0, 5000, (64,), device=dev)
        loss, lse = torch.empty(64, device=dev), torch.empty(64, device=dev)
        grad = torch.empty_like(x)
        cross_entropy.forward(x, target, None, loss, lse, torch.empty_like(lse), grad, torch.ones(64, device=dev),
                              LossOptions(ignore_index=-100, label_smoothing=0.0, softcap=0.0, lse_square_scale=0.0))
        cross_entropy.scale(grad, torch.full((1,), 0.5, device=dev))
    expected_loss, _, _, expected_grad, _ = cross_entropy_contract(x, target, grad_scale=torch.full((64,), 0.5))
    assert_close(y, reference_softmax(x, -1, False), torch.float32, "cuda:1 softmax")
    assert_close(loss, expected_loss, torch.float32, "cuda:1 loss")
    assert_close(grad, expected_grad, torch.float32, "cuda:1 gradient")


def _registers_only(monkeypatch):
    """The block-sparse forward on the register kernel, as on unaligned blocks or before sm_80."""
    monkeypatch.setattr(_tuning, "blocksparse_staged_config", lambda *args: None)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unaligned", [False, True])
def test_blocksparse_rows_of_several_tiles(dtype, unaligned, monkeypatch):
    """Rows longer than one tile (read twice), and element-wise loads when the blocks are not 16-byte aligned."""
    _, _, blocksparse = _kernels()
    _registers_only(monkeypatch)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_FORWARD_FLOATS", {4: (1,), 2: (1,)})
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_BACKWARD_FLOATS", {4: (1,), 2: (1,)})
    g = torch.Generator().manual_seed(3)
    layout = random_layout(2, 6, 48, g)
    layout[1, 5, 7] = 1
    layout[1, 5, :5] = 0  # only above the diagonal: fully masked when causal
    lut = lookup_table(layout, 16, _device())
    shape = (2, lut.nnz, 16, 16)
    storage = torch.randn(2 * lut.nnz * 256 + 1, device=_device()).to(dtype)
    x = storage[1:].view(shape) if unaligned else storage[:-1].view(shape)
    dy = torch.randn(shape, device=_device()).to(dtype)
    for causal in (False, True):
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, 0.5, causal)
        assert_close(y, reference_blocksparse(x, layout, 16, 0.5, causal), dtype, f"forward causal={causal}")
        dx_storage = torch.empty_like(storage)
        dx = dx_storage[1:].view(shape) if unaligned else dx_storage[:-1].view(shape)
        blocksparse.backward(y, dy, dx, lut, 0.5)
        assert_close(dx, reference_blocksparse_backward(y, dy, layout, 16, 0.5)[0], dtype, "backward")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward_lane_bytes", [1e-9, 1e9], ids=["warp", "fewest"])
@pytest.mark.parametrize("cfg", _tuning.BLOCKSPARSE_CONFIGS, ids=lambda c: f"vpt{c.vpt}")
def test_blocksparse_every_tile_size(cfg, backward_lane_bytes, dtype, monkeypatch):
    """Each compiled tile size, forward and backward, on rows of one to several tiles (whichever the layout's mean
    row would choose), with and without the causal mask and with a negative scale; the backward a warp a row or
    with the fewest lanes a row (a block's row: 2 bf16, 4 float32 vectors; 16 or 8 rows a warp)."""
    _, _, blocksparse = _kernels()
    _registers_only(monkeypatch)
    monkeypatch.setattr(_tuning, "blocksparse_config", lambda *_: cfg)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_BACKWARD_LANE_BYTES", backward_lane_bytes)
    g = torch.Generator().manual_seed(cfg.vpt)
    layout = random_layout(2, 6, 160, g)
    layout[1, 5, :5] = 0
    layout[1, 5, 7] = 1  # only above the diagonal: fully masked when causal
    lut = lookup_table(layout, 16, _device())
    lanes = _tuning.blocksparse_backward_lanes(lut.mean_blocks * 16, 16, dtype.itemsize)
    assert lanes == (32 if backward_lane_bytes < 1 else max(2, dtype.itemsize))  # 32 / B, or a block's row
    x = torch.randn(2, lut.nnz, 16, 16, device=_device()).to(dtype)
    dy = torch.randn_like(x)
    for causal, scale in ((False, 0.5), (True, 0.5), (False, -0.8)):
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, scale, causal)
        assert_close(y, reference_blocksparse(x, layout, 16, scale, causal), dtype,
                     f"forward causal={causal} scale={scale}")
        dx = torch.empty_like(x)
        blocksparse.backward(y, dy, dx, lut, scale)
        assert_close(dx, reference_blocksparse_backward(y, dy, layout, 16, scale)[0], dtype, "backward")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lane_vectors", [1e-9, 1000], ids=["warp", "fewest"])
@pytest.mark.parametrize("cap", _tuning.BLOCKSPARSE_STAGED_CAPS)
def test_blocksparse_every_staged_buffer(cap, lane_vectors, dtype, monkeypatch):
    """The staged forward with each compiled shared-memory buffer, on rows of one to several parts (rows of up to
    2560 elements; the smallest buffer holds 256 float32 or 512 16-bit ones), with and without the causal mask (a
    row with no kept element among them), with a negative and a zero scale, a warp a row or several rows a warp
    (as few lanes a row as the buffers allow: the rows of a warp differ in length where causal); the backward of
    its output."""
    _, _, blocksparse = _kernels()
    smallest = _tuning.BLOCKSPARSE_STAGED_CAPS[0] * 8  # 16-bit elements the smallest buffer holds
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STAGED_CAPS", (cap,))
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STAGED_LANE_VECTORS", lane_vectors)
    g = torch.Generator().manual_seed(cap)
    layout = random_layout(2, 6, 160, g)
    layout[1, 5, :5] = 0
    layout[1, 5, 7] = 1  # only above the diagonal: fully masked when causal
    lut = lookup_table(layout, 16, _device())
    assert lut.max_blocks * 16 > 2 * smallest  # three parts or more
    x = torch.randn(2, lut.nnz, 16, 16, device=_device()).to(dtype)
    dy = torch.randn_like(x)
    cfg = blocksparse._staged_config(x, x, lut)
    assert cfg.cap == cap and (cfg.lanes < 32) == (lane_vectors > 1)
    for causal, scale in ((False, 0.5), (True, 0.5), (False, -0.8), (True, 0.0)):
        y = torch.full_like(x, float("nan"))
        blocksparse.forward(x, y, lut, scale, causal)
        assert_close(y, reference_blocksparse(x, layout, 16, scale, causal), dtype,
                     f"forward causal={causal} scale={scale}")
        dx = torch.full_like(x, float("nan"))
        blocksparse.backward(y, dy, dx, lut, scale)
        assert_close(dx, reference_blocksparse_backward(y, dy, layout, 16, scale)[0], dtype, "backward")


@gpu
def test_blocksparse_forward_stages_only_aligned_blocks(monkeypatch):
    """The staged kernel needs 16-byte aligned blocks: others take the register kernel (and still match float64)."""
    _, _, blocksparse = _kernels()
    chosen = []
    monkeypatch.setattr(_instances, "blocksparse_staged_kernel",
                        lambda *args, real=_instances.blocksparse_staged_kernel: chosen.append(args) or real(*args))
    layout = torch.ones(1, 4, 64, dtype=torch.long)
    lut = lookup_table(layout, 16, _device())
    storage = torch.randn(lut.nnz * 256 + 1, device=_device()).to(torch.bfloat16)
    for x, staged in ((storage[:-1].view(1, lut.nnz, 16, 16), True), (storage[1:].view(1, lut.nnz, 16, 16), False)):
        chosen.clear()
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, 0.5, False)
        assert bool(chosen) == staged
        assert_close(y, reference_blocksparse(x, layout, 16, 0.5, False), torch.bfloat16, f"staged={staged}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", RULE_CONFIGS, ids=str)
def test_softmax_rule_configs_match_float64(cfg, dtype, monkeypatch):
    """Each configuration of SOFTMAX_RULES (several row groups a warp), on 5 rows (row groups past the last row
    with ROWS > 5, which must write nothing: the rows after the outputs hold a sentinel), one tile and two and a
    bit."""
    softmax, _, _ = _kernels()
    for paths_before_rules in ("STAGED_WARP_COLUMNS", "STAGED_BLOCK_COLUMNS", "SPLIT_MIN_COLUMNS"):
        monkeypatch.setattr(_tuning, paths_before_rules, {})
    rows = 5
    for cols in (cfg.capacity(dtype.itemsize), 2 * cfg.capacity(dtype.itemsize) + 3):
        monkeypatch.setattr(_tuning, "SOFTMAX_RULES", tuple((d, dtype.itemsize, 0, cols, cfg) for d in ("fwd", "bwd")))
        x = torch.randn(rows, cols, device=_device()).mul(4).to(dtype)
        dy = torch.randn_like(x)
        outputs = torch.full((2, rows + 3, cols), 7.0, device=_device()).to(dtype)
        y, dx = outputs[0, :rows], outputs[1, :rows]
        softmax.forward(x, y, False)
        assert_close(y, reference_softmax(x, -1, False), dtype, f"forward {cols}")
        softmax.backward(y, dy, dx, False)
        assert_close(dx, reference_softmax_backward(y, dy, -1, False), dtype, f"backward {cols}")
        assert (outputs[:, rows:] == 7).all(), "written past the last row"


# (weighted, label_smoothing, softcap, lse_square_scale, one grad_scale for every row): each option alone, then all
CE_OPTIONS = ((False, 0.0, 0.0, 0.0, True), (True, 0.1, 0.0, 0.0, False), (False, 0.0, 5.0, 0.0, False),
              (False, 0.0, 0.0, 1e-2, True), (True, 0.2, 3.0, 1e-3, False))
CE_NAN_ROW = 6  # a row with a NaN logit


def cross_entropy_inputs(rows, classes, dtype, target_dtype=torch.int64, unaligned=False, seed=0):
    """Logits (a NaN in row CE_NAN_ROW, row 7 shifted by 100; with `unaligned`, rows one element off 16-byte
    alignment) and targets: row 1 ignored (-100), rows 2, 4 and 8 invalid (C, -5, the index type's largest
    magnitude), rows 3 and 5 the last and first class."""
    assert rows >= 9
    g = torch.Generator().manual_seed(seed)
    storage = (torch.randn(rows * classes + 1, generator=g) * 3).to(dtype).to(_device())
    logits = (storage[1:] if unaligned else storage[:-1]).view(rows, classes)
    logits[7] += 100  # exp(100) is beyond float32: the row's max must come out first
    logits[CE_NAN_ROW, classes // 2] = float("nan")
    target = torch.randint(0, classes, (rows,), generator=g)
    target[1], target[2], target[3], target[4], target[5] = -100, classes, classes - 1, -5, 0
    target[8] = 2**40 if target_dtype == torch.int64 else 2**31 - 1
    return logits, target.to(target_dtype).to(_device())


def loss_options(options) -> LossOptions:
    """The kernels' ``options`` record of a CE_OPTIONS entry (ignore_index -100)."""
    _, eps, softcap, lse_square_scale, _ = options
    return LossOptions(ignore_index=-100, label_smoothing=eps, softcap=softcap, lse_square_scale=lse_square_scale)


def cross_entropy_call(cross_entropy, logits, target, weight, options, grad_scale, grad):
    """(loss, lse, row_weight) from the backend's forward under ``options`` (a LossOptions), each prefilled with
    NaN."""
    stats = torch.full((3, logits.shape[0]), float("nan"), device=_device())
    cross_entropy.forward(logits, target, weight, stats[0], stats[1], stats[2], grad, grad_scale, options)
    return stats


def check_cross_entropy(cross_entropy, logits, target, options, what):
    """The forward with a gradient (into a buffer with a sentinel row after it) and without, against the float64
    reference: loss and lse at float32's tolerance, row weights exact, the gradient at the logits' dtype's."""
    rows, classes = logits.shape
    weighted, broadcast = options[0], options[4]
    g = torch.Generator().manual_seed(classes)
    weight = torch.rand(classes, generator=g).to(_device()) if weighted else None
    if broadcast:  # a stride-0 view of one value, as the front passes a mean's 1 / denominator
        grad_scale = torch.full((1,), 0.37, device=_device()).expand(rows)
        assert grad_scale.stride(0) == 0
    else:
        grad_scale = (torch.rand(rows, generator=g) + 0.5).to(_device())
    loss, lse, row_weight, grad, _ = cross_entropy_contract(logits, target, weight, grad_scale,
                                                            loss_options(options))
    row_weight = row_weight.nan_to_num(0.0)  # the contract leaves an invalid target's open: this backend writes 0
    storage = torch.full((rows + 1, classes), 7.0, device=_device()).to(logits.dtype)
    for out, scale in ((storage[:rows], grad_scale), (None, None)):
        stats = cross_entropy_call(cross_entropy, logits, target, weight, loss_options(options), scale, out)
        label = f"{what} options={options} gradient={out is not None}"
        assert_close(stats[0], loss, torch.float32, f"loss {label}")
        assert_close(stats[1], lse, torch.float32, f"lse {label}")
        assert torch.equal(stats[2], row_weight.float()), f"row weight {label}"
    assert_close(storage[:rows], grad, logits.dtype, f"gradient {what} options={options}")
    assert (storage[rows] == 7).all(), f"written past the last row: {what}"


CE_PATHS = forced_paths("cupy")   # each forward configuration, from tests/kernel_paths.py


def _cross_entropy_path(path, monkeypatch):
    """Forces the forward configuration of ``path`` (skipped where the GPU cannot run it); returns it."""
    force(monkeypatch, "cupy", path)
    return _tuning.ce_fwd_config()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", CE_PATHS)
def test_cross_entropy_every_path_matches_float64(path, dtype, monkeypatch):
    """Each forward configuration (a warp, a block, a cluster per row) with and without the gradient, with each
    option (weights, label smoothing, softcap, z-loss, one grad_scale for all rows or one a row), on rows of part
    of a tile (some of a cluster's blocks without any), one pass, several tiles (16-byte vectors, element-wise
    loads, rows off alignment); ignored and invalid targets, a NaN logit, a row far from 0."""
    _, cross_entropy, _ = _kernels()
    cfg = _cross_entropy_path(path, monkeypatch)
    capacity, vec = cfg.capacity(dtype.itemsize), 16 // dtype.itemsize
    for classes, unaligned in ((37, False), (capacity, False), (3 * capacity, False), (2 * capacity + 5, False),
                               (capacity + vec, True)):
        logits, target = cross_entropy_inputs(9, classes, dtype, unaligned=unaligned, seed=classes)
        for options in CE_OPTIONS:
            check_cross_entropy(cross_entropy, logits, target, options, f"{classes} classes unaligned={unaligned}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", CE_PATHS)
def test_cross_entropy_in_place_equals_a_separate_gradient(path, dtype, monkeypatch):
    """grad_logits = logits: every element is read before it is overwritten, so the result is bit for bit the
    gradient written to a separate buffer (one tile from registers; several re-read), int32 targets."""
    _, cross_entropy, _ = _kernels()
    cfg = _cross_entropy_path(path, monkeypatch)
    capacity = cfg.capacity(dtype.itemsize)
    for classes, options in itertools.product((37, capacity, 3 * capacity + 5), CE_OPTIONS[::4]):
        logits, target = cross_entropy_inputs(9, classes, dtype, torch.int32, seed=classes)
        weight = torch.rand(classes, device=_device()) if options[0] else None
        grad_scale = torch.rand(9, device=_device()) + 0.5
        separate = torch.empty_like(logits)
        stats = cross_entropy_call(cross_entropy, logits, target, weight, loss_options(options), grad_scale, separate)
        in_place = logits.clone()
        in_place_stats = cross_entropy_call(cross_entropy, in_place, target, weight, loss_options(options), grad_scale,
                                            in_place)
        torch.testing.assert_close(in_place, separate, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(in_place_stats, stats, rtol=0, atol=0, equal_nan=True)
        assert_close(separate, cross_entropy_contract(logits, target, weight, grad_scale, loss_options(options)).grad,
                     dtype, f"gradient {classes} classes options={options}")


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("blocks_per_sm", [_tuning.CE_SCALE_BLOCKS_PER_SM, 0], ids=["grid", "one-row-of-blocks"])
def test_cross_entropy_scale(dtype, blocks_per_sm, monkeypatch):
    """scale(): one factor of 1 leaves the buffer bit for bit (NaN payloads too); one factor, or one a row (1 leaves
    its row bit for bit; 0 * inf and NaN give NaN), as torch's float32 product rounded to the dtype; element-wise,
    vector and unaligned rows of one or several tiles; the blocks walking the rows when they are fewer."""
    _, cross_entropy, _ = _kernels()
    monkeypatch.setattr(_tuning, "CE_SCALE_BLOCKS_PER_SM", blocks_per_sm)
    capacity, vec = _tuning.CE_SCALE_CONFIG.capacity(dtype.itemsize), 16 // dtype.itemsize
    rows = 7
    per_row = torch.tensor([1.0, 0.0, float("inf"), float("nan"), -2.5, 1.0, 3.0], device=_device())
    for classes, unaligned in ((37, False), (2 * capacity + vec, False), (capacity + vec, True)):
        storage = (torch.randn(rows * classes + 1) * 100).to(dtype).to(_device())
        storage[::97], storage[5::101], storage[7::89] = float("nan"), float("inf"), 0.0
        buffer = (storage[1:] if unaligned else storage[:-1]).view(rows, classes)
        original = buffer.clone()
        cross_entropy.scale(buffer, torch.ones(1, device=_device()))
        assert torch.equal(_bits(buffer), _bits(original)), "a factor of 1 changed the buffer"
        for factor in (torch.full((1,), 0.5, device=_device()), torch.full((1,), -3.0, device=_device()), per_row):
            buffer.copy_(original)
            cross_entropy.scale(buffer, factor)
            expected = (original.float() * (factor if factor.numel() == 1 else factor[:, None])).to(dtype)
            torch.testing.assert_close(buffer, expected, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(_bits(buffer[[0, 5]]), _bits(original[[0, 5]])), "a row's factor of 1 changed the row"


@gpu
def test_cross_entropy_scale_reads_its_factor_on_the_device():
    """A CUDA graph captured once scales by the factor the tensor holds at each replay (1 leaves the buffer)."""
    _, cross_entropy, _ = _kernels()
    buffer = torch.randn(5, 3000, device=_device())
    original = buffer.clone()
    factor = torch.full((1,), 2.0, device=_device())
    cross_entropy.scale(buffer.clone(), factor)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cross_entropy.scale(buffer, factor)
    for value in (1.0, 2.0, 1.0, 0.5):
        factor.fill_(value)
        graph.replay()
        original *= value
        torch.cuda.synchronize()
        assert torch.equal(buffer, original), value


# ---- cross-entropy over a slice of the classes (vocabulary-parallel): row_stats and ce_gradient


def test_cross_entropy_gradient_instances_are_compiled():
    """Every ce_gradient instance gradient() can launch (each element type, index type, with and without a softcap)
    is among the expressions tests/test_cuda_sources_compile.py compiles; its grid covers every tile and row
    within the grid's limits."""
    for ctype, index_type, softcap in itertools.product(_instances.CUDA_TYPES, _instances.INDEX_TYPES, (False, True)):
        expression = _instances.ce_gradient_kernel(ctype, index_type, softcap, _tuning.CE_GRADIENT_CONFIG)
        for cc in (80, 90):
            assert expression in _instances.expressions(_instances.CROSS_ENTROPY_SOURCE, ctype, cc), expression
    capacity = _tuning.CE_GRADIENT_CONFIG.capacity(2)
    assert _tuning.ce_gradient_grid(5, 3 * capacity + 1, 2) == (4, 5, 1)
    assert _tuning.ce_gradient_grid(100_000, 7, 4) == (1, _tuning.MAX_GRID_Y, 1)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cross_entropy_gradient_of_a_slice_on_long_rows(dtype):
    """ce_gradient on rows of one to several of its tiles (and a part of one), aligned or not, in place or into a
    buffer with a sentinel row after it; targets in the slice, outside it and ignore_index; the whole row's m and S
    from a wider float64 row; a NaN statistic makes its row NaN."""
    _, cross_entropy, _ = _kernels()
    capacity, vec = _tuning.CE_GRADIENT_CONFIG.capacity(dtype.itemsize), 16 // dtype.itemsize
    for classes, unaligned, weighted, softcap, in_place in (
            (37, False, True, 0.0, False), (capacity, False, False, 5.0, True),
            (3 * capacity + 5, False, True, 0.0, True), (2 * capacity + vec, True, True, 3.0, False),
            (3 * capacity, True, False, 0.0, True)):
        rows = 9
        g = torch.Generator().manual_seed(classes)
        wide = (torch.randn(rows, classes + 50, generator=g, dtype=torch.float64) * 3).to(dtype).double().to(_device())
        wide[:, -1] += 6.0
        u = softcap * torch.tanh(wide / softcap) if softcap else wide
        m = u.max(1).values
        row_max_sum = torch.stack([m, torch.exp(u - m[:, None]).sum(1)]).float()
        row_max_sum[1, 4] = float("nan")
        storage = torch.full(((rows + 1) * classes + 1,), 7.0, device=_device(), dtype=dtype)
        logits = (storage[1:] if unaligned else storage[:-1])[:rows * classes].view(rows, classes)
        logits.copy_(wide[:, 10:10 + classes])
        original = logits.clone()
        target = torch.tensor([0, classes - 1, classes // 2, -1, classes, -100, 2**40, 5, classes + 3],
                              device=_device())
        weight = (torch.rand(classes, generator=g) + 0.5).to(_device()) if weighted else None
        coefficients = torch.rand(3, rows, generator=g).to(_device()) + torch.tensor([[0.5], [0.5], [0.0]],
                                                                                     device=_device())
        grad_storage = torch.full((rows + 1, classes), 7.0, device=_device(), dtype=dtype)
        grad = logits if in_place else grad_storage[:rows]
        cross_entropy.gradient(logits, target, weight, row_max_sum, coefficients, grad, LossOptions(softcap=softcap))
        torch.cuda.synchronize()
        label = f"{classes} classes unaligned={unaligned} softcap={softcap} in_place={in_place}"
        expected, magnitude = reference_slice_gradient(original, target, weight, row_max_sum, coefficients, softcap)
        assert_close(grad, expected, dtype, label, magnitude)
        assert torch.isnan(grad[4]).all(), f"a NaN S: {label}"
        written = storage[1:] if unaligned else storage[:-1]
        assert (written[rows * classes:] == 7).all() and storage[0 if unaligned else -1] == 7, f"past: {label}"
        if not in_place:
            assert torch.equal(_bits(logits), _bits(original)), f"logits written: {label}"
            assert (grad_storage[rows] == 7).all(), f"written past the last row: {label}"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", CE_PATHS)
def test_cross_entropy_row_stats_on_every_path(path, dtype, monkeypatch):
    """forward(..., row_stats) on each forward configuration: each row's m, S and sum w u (0 without label
    smoothing) against float64 (a NaN row, a row far from 0, ignored and invalid targets), and loss, lse,
    row_weight and gradient bit for bit as without row_stats."""
    _, cross_entropy, _ = _kernels()
    cfg = _cross_entropy_path(path, monkeypatch)
    capacity = cfg.capacity(dtype.itemsize)
    for classes, options in itertools.product((37, 3 * capacity + 5), CE_OPTIONS[:2] + CE_OPTIONS[4:]):
        weighted = options[0]
        logits, target = cross_entropy_inputs(9, classes, dtype, seed=classes)
        weight = torch.rand(classes, device=_device()) + 0.5 if weighted else None
        grad_scale = torch.rand(9, device=_device()) + 0.5
        plain_grad, stats_grad = torch.empty_like(logits), torch.empty_like(logits)
        plain = cross_entropy_call(cross_entropy, logits, target, weight, loss_options(options), grad_scale,
                                   plain_grad)
        row_stats = torch.full((3, 9), 12345.0, device=_device())
        with_stats = torch.full((3, 9), float("nan"), device=_device())
        cross_entropy.forward(logits, target, weight, *with_stats, stats_grad, grad_scale, loss_options(options),
                              row_stats=row_stats)
        label = f"{classes} classes options={options}"
        torch.testing.assert_close(with_stats, plain, rtol=0, atol=0, equal_nan=True, msg=label)
        torch.testing.assert_close(stats_grad, plain_grad, rtol=0, atol=0, equal_nan=True, msg=label)
        assert_row_stats(row_stats, row_stats_contract(logits, weight, loss_options(options)), label)
        assert torch.isnan(row_stats[:2, CE_NAN_ROW]).all(), label
