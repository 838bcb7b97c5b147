"""CuPy backend: description without the framework (runs anywhere) and GPU behaviour (skips without CUDA + cupy).

The kernels are called directly through the backend contract, against float64
references written here, so these tests do not depend on the front's dispatch (only on
its look-up table for the block-sparse kernels).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))
import multisoft_cupy  # noqa: E402
from multisoft_cupy import _catalog  # noqa: E402

from multisoft._blocksparse import lookup_table  # noqa: E402  (the front's look-up table: torch only, no backend)
from multisoft.check import reference_blocksparse, softmax_backward_magnitude  # noqa: E402  (float64 only, no backend)

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 2e-3), torch.bfloat16: (1e-3, 1.6e-2)}


# ---- float64 references and checks (also used by benchmarks/_cupy_probe.py) ----

def max_ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, magnitude=None) -> float:
    """max |actual - expected| / (atol + rtol magnitude), magnitude |expected| unless given; matching NaNs /
    infinities count as equal."""
    atol, rtol = TOLERANCES[dtype]
    a, e = actual.double(), expected.double()
    m = e.abs() if magnitude is None else magnitude.double()
    same = (a == e) | (a.isnan() & e.isnan())
    err = torch.where(same, 0.0, (a - e).abs())
    return float((err / (atol + rtol * m.nan_to_num(posinf=0.0))).max())


def check(actual, expected, dtype, what, magnitude=None) -> float:
    ratio = max_ratio(actual, expected, dtype, magnitude)
    assert ratio <= 1.0, f"{what}: error is {ratio:.3g} x the tolerance"
    return ratio


def ce_reference(logits, target, weight, ignore_index, eps):
    """(loss per row, lse, d loss_i / d logits_i) in float64; rows with invalid targets get NaN loss."""
    x = logits.double()
    rows, classes = x.shape
    t = target.long()
    ignored = t == ignore_index
    invalid = ~ignored & ((t < 0) | (t >= classes))
    safe = torch.where(ignored | invalid, 0, t)
    w = weight.double() if weight is not None else torch.ones(classes, dtype=torch.float64, device=x.device)
    lse = x.logsumexp(-1)
    p = (x - lse[:, None]).exp()
    wt = w[safe]
    loss = (1 - eps) * wt * (lse - x.gather(1, safe[:, None])[:, 0]) + eps / classes * (w * (lse[:, None] - x)).sum(-1)
    loss = torch.where(ignored, 0.0, torch.where(invalid, float("nan"), loss))
    one_hot = torch.zeros_like(p).scatter_(1, safe[:, None], 1.0)
    grad = (1 - eps) * wt[:, None] * (p - one_hot) + eps / classes * (w.sum() * p - w)
    grad = torch.where((ignored | invalid)[:, None], 0.0, grad)
    return loss, lse, grad


def blocksparse_backward_reference(y, dy, lut, scale):
    """scale * y * (dy - sum_row(y * dy)) in float64 over the compressed blocks, each row's sum over its block-row."""
    y64, dy64 = y.double(), dy.double()
    rowdot = torch.zeros(y.shape[0], lut.heads * lut.block_rows, lut.block, dtype=torch.float64, device=y.device)
    rowdot.index_add_(1, lut.rows.long(), (y64 * dy64).sum(-1))
    return scale * y64 * (dy64 - rowdot[:, lut.rows.long()][..., None])


def random_layout(heads, mb, nb, generator=None, empty_row=True):
    layout = (torch.rand(heads, mb, nb, generator=generator) < 0.4).long()
    layout[:, :, 0] = 1
    if empty_row and mb > 1:
        layout[0, 1] = 0  # a block-row without blocks
    return layout


# ---- no GPU needed ----

def test_description_without_cupy_import():
    code = ("import sys, torch; sys.path.insert(0, 'backends'); import multisoft_cupy as m; "
            "r = m.unavailable_reason(torch.device('cpu'), torch.float32); "
            "assert r == 'CuPy runs only on CUDA devices', r; "
            "assert m.NAME == 'cupy' and m.PRIORITY == 200; m.version(); "
            "assert 'cupy' not in sys.modules, 'imported cupy'")
    root = os.path.join(os.path.dirname(__file__), "..")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_version_is_installed_distribution_or_none():
    v = multisoft_cupy.version()
    assert v is None or v[0].isdigit()
    if importlib.util.find_spec("cupy") is None:
        reason = multisoft_cupy.unavailable_reason(torch.device("cuda", 0), torch.float32)
        assert reason is not None


@pytest.mark.parametrize("elem", [4, 2])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("cc", [80, 90])
def test_softmax_config_is_compiled_and_loops_little(direction, cc, elem):
    widest = max(c.capacity(elem) for c in _catalog.SOFTMAX_CONFIGS if c.cluster == 1 or cc >= 90)
    for cols in (1, 7, 128, 256, 512, 1000, 1024, 4096, 5000, 32768, 131072, 262144, 1 << 20):
        cfg = _catalog.softmax_config(direction, cols, elem, cc)
        assert cfg in _catalog.SOFTMAX_CONFIGS + _catalog.SOFTMAX_RULE_CONFIGS
        assert 4 * cfg.capacity(elem) >= min(cols, widest), (cols, cfg)
        assert cc >= 90 or cfg.cluster == 1
        assert _catalog.softmax_kernel(direction, "float", cfg) in _catalog.expressions("softmax.cu", "float", cc)


@pytest.mark.parametrize("elem", [4, 2])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("cc", [80, 90])
def test_staged_config_covers_the_row_in_compiled_kernels(direction, cc, elem, monkeypatch):
    monkeypatch.setattr(_catalog, "STAGED_BLOCK_COLUMNS", {(direction, elem): (999, math.inf)})
    monkeypatch.setattr(_catalog, "STAGED_WARP_COLUMNS", {})
    assert _catalog.staged_config(direction, 999, elem, cc, 227 * 1024) is None
    assert _catalog.staged_config(direction, 1000, elem, 75, 227 * 1024) is None
    expressions = _catalog.expressions("softmax.cu", "float", cc)
    most = max(_catalog.STAGED_CLUSTERS) if cc >= 90 else 1
    vec = 16 // elem
    for cols in (1000, 1008, 65536, 131072, 262144 + 24, 1 << 20):
        for max_shared in (32 * 1024, 99 * 1024, 227 * 1024):
            cfg = _catalog.staged_config(direction, cols, elem, cc, max_shared)
            if cfg is None:  # no slice small enough: the register kernels take the row
                smallest = _catalog.StagedConfig(512, 1, most, -(-cols // most // vec) * vec)
                assert smallest.shared_bytes(direction, elem) > min(max_shared, _catalog.STAGED_BLOCK_BYTES)
                continue
            assert cfg.slice % vec == 0 and cfg.cluster * cfg.slice >= cols > (cfg.cluster - 1) * cfg.slice
            assert cfg.shared_bytes(direction, elem) <= min(max_shared, _catalog.STAGED_BLOCK_BYTES)
            assert cfg.cluster <= most and cfg.rows == 1
            assert cfg.threads == _catalog.STAGED_BLOCK_THREADS[direction]
            assert _catalog.staged_kernel(direction, "float", cfg) in expressions
            for rows in (1, 7, 1024, 1 << 31):
                grid = _catalog.staged_grid(rows, cfg)
                assert grid % cfg.cluster == 0 and 0 < grid <= min(rows * cfg.cluster, _catalog.MAX_GRID)


@pytest.mark.parametrize("elem", [4, 2])
def test_staged_warps_take_their_column_range(elem, monkeypatch):
    monkeypatch.setattr(_catalog, "STAGED_WARP_COLUMNS", {("fwd", elem): (512, 2048)})
    monkeypatch.setattr(_catalog, "STAGED_BLOCK_COLUMNS", {("fwd", elem): (8191, math.inf)})
    assert _catalog.staged_config("fwd", 512, elem, 90, 227 * 1024) is None
    assert _catalog.staged_config("bwd", 1024, elem, 90, 227 * 1024) is None
    expressions = _catalog.expressions("softmax.cu", "bf16_t", 80)
    for cols in (513, 1024, 2048):
        cfg = _catalog.staged_config("fwd", cols, elem, 80, 227 * 1024)
        assert (cfg.tpr, cfg.rows, cfg.cluster) == (32, _catalog.STAGED_WARP_ROWS, 1) and cfg.slice >= cols
        assert _catalog.staged_kernel("fwd", "bf16_t", cfg) in expressions
        assert _catalog.staged_grid(100, cfg) == -(-100 // cfg.rows)
    assert _catalog.staged_config("fwd", 2049, elem, 90, 227 * 1024) is None
    too_large = _catalog.STAGED_WARP_ROWS * 2048 * elem - 1
    monkeypatch.setattr(_catalog, "STAGED_BLOCK_BYTES", too_large)
    assert _catalog.staged_config("fwd", 2048, elem, 90, 227 * 1024) is None
    assert _catalog.staged_config("fwd", 8192, elem, 90, 227 * 1024).tpr > 32


def test_expressions_cover_chosen_kernels():
    for cc in (80, 90):
        for rows, classes in ((1, 10), (64, 262144), (8192, 32000)):
            cfg = _catalog.ce_fwd_config(rows, classes, 2, cc, 132)
            assert _catalog.ce_fwd_kernel("bf16_t", "long long", cfg) in _catalog.expressions(
                "cross_entropy.cu", "bf16_t", cc)
        assert not any("cluster" in e for s in _catalog.SOURCES for e in _catalog.expressions(s, "float", 80))


def test_expressions_cover_chosen_blocksparse_kernels():
    """Whatever lanes a row the launchers choose (compiled as a constant or taken at launch), the kernel is one that
    CI compiles: staged forward and register backward, mean rows from a block to 16384, every block size."""
    for elem, ctype_ in ((4, "float"), (2, "bf16_t")):
        expressions = set(_catalog.expressions("blocksparse.cu", ctype_, 90))
        for block in (16, 32, 64, 128):
            for mean_row in (block, 450, 1024, 2048, 16384):
                staged = _catalog.blocksparse_staged_config(mean_row, 2 * mean_row, elem, 90, block)
                assert _catalog.blocksparse_staged_kernel(ctype_, staged) in expressions, (elem, block, mean_row)
                lanes = _catalog.blocksparse_backward_lanes(mean_row, block, elem)
                for cfg in _catalog.BLOCKSPARSE_CONFIGS:  # the backward's tile: one of these, by the mean row
                    assert _catalog.blocksparse_kernel("bwd", ctype_, cfg, lanes) in expressions, (elem, block, lanes)


def _kernel_parameters(source: str, name: str) -> list[str]:
    """C types of the parameters of kernel template `name` in `source`."""
    import re
    code = (_catalog.PACKAGE_DIR / source).read_text()
    match = re.search(r"\)\s+" + name + r"\(([^)]*)\)", code)
    assert match, name
    return [" ".join(p.split()[:-1]) for p in match.group(1).split(",")]


_NUMPY_FOR_C = {"i64": "int64", "int": "int32", "float": "float32"}


def test_launch_arguments_match_kernel_signatures(monkeypatch):
    """RawKernel checks nothing: every argument's numpy type must match the C parameter."""
    import types

    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    from multisoft_cupy import _module, blocksparse, cross_entropy, softmax

    calls = []
    monkeypatch.setattr(_module, "launch",
                        lambda t, src, expr, grid, block, args, shared_mem=0: calls.append((src, expr, args)))
    for mod in (softmax, cross_entropy, blocksparse):
        monkeypatch.setattr(mod, "launch", _module.launch, raising=True)
    for mod in (softmax, cross_entropy, blocksparse):
        monkeypatch.setattr(mod, "device_info", lambda index: (90, 132))
        monkeypatch.setattr(mod, "device_index", lambda t: 0)
    monkeypatch.setattr(softmax, "shared_memory", lambda index: 227 * 1024)
    x = torch.randn(4, 300)
    softmax.forward(x, torch.empty_like(x), True)
    softmax.backward(x, x, torch.empty_like(x), False)
    monkeypatch.setattr(_catalog, "STAGED_BLOCK_COLUMNS", {("fwd", 4): (255, math.inf), ("bwd", 4): (255, math.inf)})
    for cluster in (1, 2):
        monkeypatch.setattr(_catalog, "STAGED_CLUSTERS", (cluster,))
        softmax.forward(x, torch.empty_like(x), True)
        softmax.backward(x, x, torch.empty_like(x), False)
    assert sum("staged" in expression for _, expression, _ in calls) == 4
    monkeypatch.setattr(_catalog, "SPLIT_MIN_COLUMNS", {("fwd", 4): 256, ("bwd", 4): 256})
    softmax.forward(x, torch.empty_like(x), True)
    softmax.backward(x, x, torch.empty_like(x), False)
    assert sum("split" in expression for _, expression, _ in calls) == 2
    target = torch.zeros(4, dtype=torch.int64)
    w = torch.ones(300)
    cross_entropy.forward(x, target, w, torch.empty(4), torch.empty(4), torch.empty(4), -100, 0.1)
    cross_entropy.backward(x, target, None, None, torch.empty(4), torch.empty(4), x, -100, 0.0)
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    lut = lookup_table(layout, 16, "cpu")
    xb = torch.randn(1, lut.nnz, 16, 16)
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_FROM", 0)
    for staged in (True, False):
        monkeypatch.setattr(blocksparse, "STAGED", staged)
        blocksparse.forward(xb, torch.empty_like(xb), lut, 1.0, True)
        blocksparse.backward(xb, xb, torch.empty_like(xb), lut, 1.0)
    assert [expression.split("<")[0] for _, expression, _ in calls[-4:]] == ["bs_fwd_staged", "bs_bwd", "bs_fwd",
                                                                             "bs_bwd"]
    assert len(calls) == 14
    for source, expression, args in calls:
        params = _kernel_parameters(source, expression.split("<")[0])
        assert len(params) == len(args), expression
        for param, arg in zip(params, args):
            expected = "uint64" if param.endswith("*") else _NUMPY_FOR_C[param.replace("const ", "")]
            assert type(arg).__name__ == expected, (expression, param, type(arg))


def test_launch_opts_in_to_large_shared_memory_once(monkeypatch):
    """Beyond 48 KB of dynamic shared memory a kernel needs the opt-in attribute: set once per device and
    kernel for the largest size asked (again after clear_cache reloads the modules), never for 48 KB or less;
    every launch gets its bytes."""
    import contextlib
    import types

    if importlib.util.find_spec("cupy") is None:
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    from multisoft_cupy import _module

    class Kernel:
        def __init__(self):
            self.opt_ins, self.shared = [], []

        max_dynamic_shared_size_bytes = property(None, lambda self, size: self.opt_ins.append(size))

        def __call__(self, grid, block, args, shared_mem=0):
            self.shared.append(shared_mem)

    kernels = {}
    monkeypatch.setattr(_module, "kernel",
                        lambda index, src, element, expr: kernels.setdefault((index, expr), Kernel()))
    monkeypatch.setattr(_module, "cupy", SimpleNamespace(cuda=SimpleNamespace(Device=contextlib.nullcontext)))
    monkeypatch.setattr(_module, "_stream", contextlib.nullcontext)
    monkeypatch.setattr(_module, "device_index", lambda t: t.numel())  # a tensor of n elements: device n
    monkeypatch.setattr(_module, "_shared_set", {})
    kb = 1024
    for device, expr, size in ((1, "a", 64 * kb), (1, "a", 64 * kb), (1, "b", 48 * kb), (1, "a", 32 * kb),
                               (1, "a", 100 * kb), (2, "a", 64 * kb)):
        _module.launch(torch.empty(device), "softmax.cu", expr, (1, 1, 1), (32, 1, 1), (), shared_mem=size)
    assert kernels[(1, "a")].opt_ins == [64 * kb, 100 * kb] and kernels[(2, "a")].opt_ins == [64 * kb]
    assert kernels[(1, "b")].opt_ins == []
    assert kernels[(1, "a")].shared == [64 * kb, 64 * kb, 32 * kb, 100 * kb]
    _module.clear_cache()
    _module.launch(torch.empty(1), "softmax.cu", "a", (1, 1, 1), (32, 1, 1), (), shared_mem=64 * kb)
    assert kernels[(1, "a")].opt_ins == [64 * kb, 100 * kb, 64 * kb]


def check_rows(softmax, x, dy, dtype, what, backward_by_terms=False) -> None:
    """softmax and log_softmax of `x`, forward and backward (with `dy`, at the float64 forward rounded to
    `dtype`, NaN rows as 0), through the backend's softmax module, against float64. The backward error is
    measured against |dx|, or with `backward_by_terms` against the size of dx's terms
    (multisoft.check.softmax_backward_magnitude)."""
    for log in (False, True):
        y = torch.empty_like(x)
        softmax.forward(x, y, log)
        ref = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
        check(y, ref, dtype, f"forward log={log} {what}")
        y = torch.where(ref.isnan(), 0.0, ref).to(dtype)
        dx = torch.empty_like(x)
        softmax.backward(y, dy, dx, log)
        y64, dy64 = y.double(), dy.double()
        dot = dy64.sum(-1, True) if log else (y64 * dy64).sum(-1, True)
        ref_dx = dy64 - y64.exp() * dot if log else y64 * (dy64 - dot)
        magnitude = softmax_backward_magnitude(y, dy, -1, log) if backward_by_terms else None
        check(dx, ref_dx, dtype, f"backward log={log} {what}", magnitude)


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
        ref = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
        check(y, ref, dtype, f"forward log={log}")
        dx = torch.empty_like(x)
        softmax.backward(y, dy, dx, log)
        y64, dy64 = y.double(), dy.double()
        ref_dx = dy64 - y64.exp() * dy64.sum(-1, keepdim=True) if log else y64 * (dy64 - (y64 * dy64).sum(-1, True))
        check(dx, ref_dx, dtype, f"backward log={log}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", _catalog.STAGED_BLOCKS + _catalog.STAGED_WARPS, ids=str)
@pytest.mark.parametrize("cluster", _catalog.STAGED_CLUSTERS)
def test_softmax_staged_rows_match_float64(cluster, group, dtype, monkeypatch):
    """Rows staged in shared memory: uneven and empty slices, blocks and clusters walking rows (a grid of one
    block or cluster), -inf entries, a row of -inf only (NaN, as torch), every direction and mode."""
    softmax, _, _ = _kernels()
    vec = 16 // dtype.itemsize
    tpr, rows = group
    if cluster > 1 and tpr <= 32:
        pytest.skip("a warp per row takes no cluster")
    if cluster > 1 and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("clusters need sm_90")
    cases = ((vec * 3, vec), (vec * (8 * 40 + 1), vec * 41), (vec * 1000, vec * 1000 // cluster),
             (vec * 37, vec * 37))
    for (cols, slice_), max_grid in itertools.product(cases, (cluster, 1 << 20)):
        cfg = _catalog.StagedConfig(tpr, rows, cluster, slice_)
        if cluster * slice_ < cols or cfg.shared_bytes("bwd", dtype.itemsize) > 160 * 1024:
            continue
        monkeypatch.setattr(_catalog, "staged_config", lambda *args, cfg=cfg: cfg)
        monkeypatch.setattr(_catalog, "MAX_GRID", max_grid)
        x = torch.randn(11, cols, device=_device()).mul(4).to(dtype)
        x[1, ::3] = float("-inf")
        x[3] = float("-inf")
        dy = torch.randn_like(x)
        check_rows(softmax, x, dy, dtype, f"cols={cols} grid<={max_grid}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads,vpt", _catalog.SPLIT_CONFIGS, ids=[f"t{t}-v{v}" for t, v in _catalog.SPLIT_CONFIGS])
@pytest.mark.parametrize("tail", [16, 3], ids=["vectors", "scalars"])
def test_softmax_split_rows_match_float64(tail, threads, vpt, dtype, monkeypatch):
    """Rows split over blocks that wait for each other: an uneven last chunk (of whole vectors, or not: scalar
    loads), a chunk of -inf only (in a row of values near -300), a row of -inf only (NaN, as torch), a NaN,
    as many chunks per row as multiprocessors over more rows than fit at once, every direction and mode."""
    softmax, _, _ = _kernels()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    chunk = threads * vpt * (16 // dtype.itemsize)
    cfg = _catalog.SplitConfig(threads, vpt, chunk)
    monkeypatch.setattr(_catalog, "split_config", lambda *args: cfg)
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
        # 0.05x of the terms' tolerance (H200, benchmarks/tune/cupy_split_error.py).
        check_rows(softmax, x, dy, dtype, f"rows={rows} cols={cols} chunk={chunk}", backward_by_terms=True)


def test_split_config_keeps_a_row_within_the_gpu(monkeypatch):
    """Split only from SPLIT_MIN_COLUMNS on, sm_80+, with no more chunks per row than multiprocessors and a
    compiled kernel; otherwise None (the caller then stages or uses registers)."""
    expressions = set(_catalog.expressions("softmax.cu", "float", 90))
    for direction, elem in _catalog.SPLIT_MIN_COLUMNS:
        low = _catalog.SPLIT_MIN_COLUMNS[(direction, elem)]
        assert _catalog.split_config(direction, 8, low - 1, elem, 90, 132) is None
        assert _catalog.split_config(direction, 8, low, elem, 75, 132) is None
        for cols in (low, 262144, 1 << 20, 1 << 23):
            cfg = _catalog.split_config(direction, 8, cols, elem, 90, 132)
            if cfg is None:
                assert all(-(-cols // (t * v * 16 // elem)) > 132 for t, v in _catalog.SPLIT_CHOICES[direction])
                continue
            assert -(-cols // cfg.chunk) <= 132 and cfg.chunk == cfg.threads * cfg.vpt * (16 // elem)
            assert _catalog.split_kernel(direction, "float", cfg) in expressions
        assert _catalog.split_config(direction, 2**31 // 8, 1 << 20, elem, 90, 132) is None
    monkeypatch.setitem(_catalog.SPLIT_CHOICES, "fwd", ((128, 4), (128, 8)))
    monkeypatch.setitem(_catalog.SPLIT_MIN_COLUMNS, ("fwd", 4), 1)
    assert _catalog.split_config("fwd", 8, 1 << 17, 4, 90, 132) == (128, 8, 4096)  # (128, 4) is not compiled


@gpu
def test_softmax_unaligned_rows_and_all_inf_row():
    softmax, _, _ = _kernels()
    base = torch.randn(3 * 4096 + 1, device=_device())
    x = base[1:].view(3, 4096)  # data pointer 4 bytes past a 16-byte boundary: scalar path
    x[1] = float("-inf")
    y = torch.empty_like(x)
    softmax.forward(x, y, False)
    assert y[1].isnan().all()
    check(y[[0, 2]], torch.softmax(x[[0, 2]].double(), -1), torch.float32, "unaligned")


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
        cross_entropy.forward(x, target, None, loss, lse, torch.empty_like(lse), -100, 0.0)
        total = loss.sum()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check(z, 2 * torch.log_softmax(x.double(), -1), torch.float32, "stream softmax")
    check(total, ce_reference(x, target, None, -100, 0.0)[0].sum(), torch.float32, "stream loss")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_cross_entropy_invalid_targets_and_in_place(dtype, target_dtype):
    _, cross_entropy, _ = _kernels()
    rows, classes = 9, 32003
    logits = torch.randn(rows, classes, device=_device()).to(dtype)
    target = torch.randint(0, classes, (rows,), device=_device())
    target[1] = -100                    # ignored
    target[2] = classes                 # invalid, one past the end
    target[3] = -5                      # invalid, negative
    target[4] = 2**40 if target_dtype == torch.int64 else 2**31 - 1
    target = target.to(target_dtype)
    weight = torch.rand(classes, device=_device())
    loss = torch.empty(rows, device=_device())
    lse = torch.empty(rows, device=_device())
    cross_entropy.forward(logits, target, weight, loss, lse, torch.empty_like(lse), -100, 0.1)
    ref_loss, ref_lse, ref_grad = ce_reference(logits, target, weight, -100, 0.1)
    assert loss[[2, 3, 4]].isnan().all() and loss[1] == 0
    check(loss, ref_loss, torch.float32, "loss")
    check(lse, ref_lse, torch.float32, "lse")
    grad_loss = torch.rand(rows, device=_device())
    valid = [0, 1, 5, 6, 7, 8]
    expected = (ref_grad * grad_loss.double()[:, None])[valid]
    original = logits.clone()
    cross_entropy.backward(logits, target, weight, weight.sum().view(1), lse, grad_loss, logits, -100, 0.1)
    check(logits[valid], expected, dtype, "in-place gradient")
    grad = torch.empty_like(original)
    cross_entropy.backward(original, target, weight, weight.sum().view(1), lse, grad_loss, grad, -100, 0.1)
    assert torch.equal(grad[valid], logits[valid])


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
        ref = reference_blocksparse(x, layout.to(_device()), block, 0.5, causal)
        check(y, ref, dtype, f"blocksparse causal={causal}")
        dx = torch.empty_like(x)
        blocksparse.backward(y, dy, dx, lut, 0.5)
        check(dx, blocksparse_backward_reference(y, dy, lut, 0.5), dtype, "blocksparse backward")


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
        cross_entropy.forward(x, target, None, loss, lse, torch.empty_like(lse), -100, 0.0)
    check(y, torch.softmax(x.double(), -1), torch.float32, "cuda:1 softmax")
    check(loss, ce_reference(x, target, None, -100, 0.0)[0], torch.float32, "cuda:1 loss")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unaligned", [False, True])
def test_blocksparse_rows_of_several_tiles(dtype, unaligned, monkeypatch):
    """Rows longer than one tile (read twice), and element-wise loads when the blocks are not 16-byte aligned."""
    _, _, blocksparse = _kernels()
    monkeypatch.setattr(blocksparse, "STAGED", False)
    monkeypatch.setattr(blocksparse, "FORWARD_FLOATS", {4: (1,), 2: (1,)})
    monkeypatch.setattr(blocksparse, "BACKWARD_FLOATS", {4: (1,), 2: (1,)})
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
        check(y, reference_blocksparse(x, layout.to(_device()), 16, 0.5, causal), dtype, f"forward causal={causal}")
        dx_storage = torch.empty_like(storage)
        dx = dx_storage[1:].view(shape) if unaligned else dx_storage[:-1].view(shape)
        blocksparse.backward(y, dy, dx, lut, 0.5)
        check(dx, blocksparse_backward_reference(y, dy, lut, 0.5), dtype, "backward")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward_lane_bytes", [None, 1e9], ids=["warp", "fewest"])
@pytest.mark.parametrize("cfg", _catalog.BLOCKSPARSE_CONFIGS, ids=lambda c: f"vpt{c.vpt}")
def test_blocksparse_every_tile_size(cfg, backward_lane_bytes, dtype, monkeypatch):
    """Each compiled tile size, forward and backward, on rows of one to several tiles (whichever the layout's mean
    row would choose), with and without the causal mask and with a negative scale; the backward a warp a row or
    with the fewest lanes a row (a block's row: 2 bf16, 4 float32 vectors; 16 or 8 rows a warp)."""
    _, _, blocksparse = _kernels()
    monkeypatch.setattr(blocksparse, "STAGED", False)
    monkeypatch.setattr(_catalog, "blocksparse_config", lambda *_: cfg)
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_BACKWARD_LANE_BYTES", backward_lane_bytes)
    g = torch.Generator().manual_seed(cfg.vpt)
    layout = random_layout(2, 6, 160, g)
    layout[1, 5, :5] = 0
    layout[1, 5, 7] = 1  # only above the diagonal: fully masked when causal
    lut = lookup_table(layout, 16, _device())
    x = torch.randn(2, lut.nnz, 16, 16, device=_device()).to(dtype)
    dy = torch.randn_like(x)
    for causal, scale in ((False, 0.5), (True, 0.5), (False, -0.8)):
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, scale, causal)
        check(y, reference_blocksparse(x, layout.to(_device()), 16, scale, causal), dtype,
              f"forward causal={causal} scale={scale}")
        dx = torch.empty_like(x)
        blocksparse.backward(y, dy, dx, lut, scale)
        check(dx, blocksparse_backward_reference(y, dy, lut, scale), dtype, "backward")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lane_vectors", [None, 1000])
@pytest.mark.parametrize("cap", _catalog.BLOCKSPARSE_STAGED_CAPS)
def test_blocksparse_every_staged_buffer(cap, lane_vectors, dtype, monkeypatch):
    """The staged forward with each compiled shared-memory buffer, on rows of one to several parts (rows of up to
    2560 elements; the smallest buffer holds 256 float32 or 512 16-bit ones), with and without the causal mask (a
    row with no kept element among them), with a negative and a zero scale, a warp a row or several rows a warp
    (as few lanes a row as the buffers allow: the rows of a warp differ in length where causal); the backward of
    its output."""
    _, _, blocksparse = _kernels()
    smallest = _catalog.BLOCKSPARSE_STAGED_CAPS[0] * 8  # 16-bit elements the smallest buffer holds
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_CAPS", (cap,))
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_LANE_VECTORS", lane_vectors)
    g = torch.Generator().manual_seed(cap)
    layout = random_layout(2, 6, 160, g)
    layout[1, 5, :5] = 0
    layout[1, 5, 7] = 1  # only above the diagonal: fully masked when causal
    lut = lookup_table(layout, 16, _device())
    assert lut.max_blocks * 16 > 2 * smallest  # three parts or more
    x = torch.randn(2, lut.nnz, 16, 16, device=_device()).to(dtype)
    dy = torch.randn_like(x)
    cfg = blocksparse._staged_config(x, x, lut)
    assert cfg.cap == cap and (cfg.lanes < 32) == (lane_vectors is not None)
    for causal, scale in ((False, 0.5), (True, 0.5), (False, -0.8), (True, 0.0)):
        y = torch.full_like(x, float("nan"))
        blocksparse.forward(x, y, lut, scale, causal)
        check(y, reference_blocksparse(x, layout.to(_device()), 16, scale, causal), dtype,
              f"forward causal={causal} scale={scale}")
        dx = torch.full_like(x, float("nan"))
        blocksparse.backward(y, dy, dx, lut, scale)
        check(dx, blocksparse_backward_reference(y, dy, lut, scale), dtype, "backward")


def test_blocksparse_forward_stages_rows_where_it_measured_faster(monkeypatch):
    """Staged on sm_80+ for a mean row of BLOCKSPARSE_STAGED_FROM elements or more, in the smallest compiled buffer
    that holds the longest row or BLOCKSPARSE_STAGED_MARGIN x the mean row if less, else the largest (longer rows are
    staged in parts)."""
    staged = _catalog.blocksparse_staged_config
    caps = _catalog.BLOCKSPARSE_STAGED_CAPS
    assert staged(1024, 1200, 2, 90, 64).cap == 256  # 1200 16-bit elements: 150 vectors
    assert staged(1024, 2080, 2, 90, 64).cap == 256  # 1.25 x 1024 elements, not the longest row's 2080
    assert staged(1024, 2080, 2, 80, 64).cap == 256
    assert staged(640, 672, 2, 90, 64).cap == 128  # the longest row: 84 vectors
    assert staged(640, 672, 4, 90, 64).cap == 256  # float32: 168 vectors
    assert staged(2048, 2300, 4, 90, 64).cap == 1024  # 575 float32 vectors
    assert staged(4096, 16384, 2, 90, 64).cap == caps[-1]  # 5120 elements: the largest buffer, rows in parts
    assert _catalog.BLOCKSPARSE_STAGED_FROM == 0 and staged(8, 8, 2, 90, 64).cap == caps[0]  # every layout
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_FROM", 512)
    assert staged(511, 1024, 2, 90, 64) is None  # shorter mean rows than the setting: registers
    assert staged(1024, 1200, 2, 75, 64) is None  # no cp.async before sm_80
    cfg = staged(1024, 1200, 2, 90, 64)   # rows / (rows a block) blocks, rounded up, within the grid limit
    assert cfg.grid(4 * cfg.rows) == 4 and cfg.grid(4 * cfg.rows + 1) == 5
    assert cfg.grid(1 << 40) == _catalog.MAX_GRID


@pytest.mark.parametrize("lane_vectors", [None, 4, 8])
def test_blocksparse_staged_lanes_per_row(lane_vectors, monkeypatch):
    """Lanes per row: the power of two nearest the mean row's 16-byte vectors over BLOCKSPARSE_STAGED_LANE_VECTORS
    (None: a warp a row), at most 32 and at least 32 / B, so that a warp's rows lie in one block-row; more where a
    block's buffers would pass STAGED_BLOCK_BYTES. A buffer per row, padded where fewer than 8 lanes would read the
    same banks, and shared memory for all of a block's rows."""
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_LANE_VECTORS", lane_vectors)
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_STAGED_FROM", 0)
    lanes = _catalog.blocksparse_staged_lanes
    if lane_vectors is None:
        assert {lanes(mean, 16, 2) for mean in (8, 450, 4096)} == {32}
    else:
        assert lanes(450, 64, 2) == (8 if lane_vectors == 8 else 16)  # 56.25 vectors: 7.0 or 14.1 a lane
        assert lanes(450, 64, 4) == (16 if lane_vectors == 8 else 32)
        assert lanes(1 << 20, 64, 2) == 32
        assert lanes(8, 4, 2) == 8 and lanes(8, 64, 2) == 1  # no more rows a warp than a block-row has
    for block in (4, 16, 32, 64, 128):
        for elem in (2, 4):
            for mean, longest in ((256, 300), (450, 1100), (1024, 1200), (2048, 4096), (8192, 8192)):
                cfg = _catalog.blocksparse_staged_config(mean, longest, elem, 90, block)
                assert 32 % cfg.lanes == 0 and block % (32 // cfg.lanes) == 0
                assert cfg.lanes >= lanes(mean, block, elem) and cfg.rows == cfg.warps * 32 // cfg.lanes
                assert cfg.row_stride == cfg.cap + (cfg.lanes if cfg.lanes < 8 else 0)
                assert cfg.shared_bytes == cfg.rows * cfg.row_stride * 16
                assert cfg.shared_bytes <= _catalog.STAGED_BLOCK_BYTES or cfg.lanes == 32


def test_blocksparse_backward_lanes_per_row(monkeypatch):
    """The backward's lanes per row: the power of two nearest the mean row's bytes over
    BLOCKSPARSE_BACKWARD_LANE_BYTES (None: 32), at most 32, at least a block's row of vectors and 32 / B."""
    lanes = _catalog.blocksparse_backward_lanes
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_BACKWARD_LANE_BYTES", None)
    assert {lanes(mean, block, 2) for mean in (16, 450, 4096) for block in (16, 128)} == {32}
    monkeypatch.setattr(_catalog, "BLOCKSPARSE_BACKWARD_LANE_BYTES", 64)
    assert lanes(450, 64, 2) == 16 and lanes(450, 64, 4) == 32   # 900 bytes: 14.1; 1800: 28.1
    assert lanes(16, 16, 2) == 2 and lanes(16, 16, 4) == 4       # a block's row: 2 or 4 vectors
    assert lanes(128, 128, 2) == 16 and lanes(1 << 20, 16, 2) == 32
    for block in (16, 32, 64, 128):
        for elem in (2, 4):
            for mean in (16, 100, 450, 1024, 8192):
                n = lanes(mean, block, elem)
                assert 32 % n == 0 and block % (32 // n) == 0 and n >= block * elem // 16


@gpu
def test_blocksparse_forward_stages_only_aligned_blocks(monkeypatch):
    """The staged kernel needs 16-byte aligned blocks: others take the register kernel (and still match float64)."""
    _, _, blocksparse = _kernels()
    chosen = []
    monkeypatch.setattr(_catalog, "blocksparse_staged_kernel",
                        lambda *args, real=_catalog.blocksparse_staged_kernel: chosen.append(args) or real(*args))
    layout = torch.ones(1, 4, 64, dtype=torch.long)
    lut = lookup_table(layout, 16, _device())
    storage = torch.randn(lut.nnz * 256 + 1, device=_device()).to(torch.bfloat16)
    for x, staged in ((storage[:-1].view(1, lut.nnz, 16, 16), True), (storage[1:].view(1, lut.nnz, 16, 16), False)):
        chosen.clear()
        y = torch.empty_like(x)
        blocksparse.forward(x, y, lut, 0.5, False)
        assert bool(chosen) == staged
        check(y, reference_blocksparse(x, layout.to(_device()), 16, 0.5, False), torch.bfloat16, f"staged={staged}")


# ---- measured exceptions (SOFTMAX_RULES, CE_FWD_RULES) and register-capped configurations ----

def test_blocksparse_values_per_thread_follow_the_mean_row():
    """The first choice whose warp tile holds the layout's mean row: float32 backward rows of 1040 elements on
    average take 64 values per thread (32 hold 1024), rows of 467 take 32; a single choice is always taken.
    (blocksparse.BACKWARD_FLOATS holds these choices for float32; its module needs cupy.)"""
    assert _catalog.blocksparse_floats((32, 64), 1040.0) == 64
    assert _catalog.blocksparse_floats((32, 64), 467.0) == 32
    assert _catalog.blocksparse_floats((32, 64), 1 << 20) == 64
    assert _catalog.blocksparse_floats((32,), 1 << 20) == 32
    assert _catalog.blocksparse_config(1280, 4, 64).vpt == 16 and _catalog.blocksparse_config(1280, 4, 32).vpt == 8
    # bf16 rows of 1059 elements on average: 40 values per thread, a tile of 5 vectors (1280 elements)
    assert _catalog.blocksparse_floats((40, 64), 1059.0) == 40 and _catalog.blocksparse_config(1059.0, 2, 40).vpt == 5
    assert _catalog.blocksparse_config(465.0, 2, 40).vpt == 2  # the tile holds the mean row, not the longest


def test_rules_pick_their_config_only_in_range(monkeypatch):
    capped = _catalog.RowConfig(32, 4, 4, 1, 8)
    clustered = _catalog.RowConfig(512, 1, 4, 8)
    monkeypatch.setattr(_catalog, "SOFTMAX_RULES", (("fwd", 2, 512, 1024, capped), ("bwd", 2, 0, 1 << 20, clustered)))
    assert _catalog.softmax_config("fwd", 1024, 2, 90) == capped
    assert _catalog.softmax_config("fwd", 512, 2, 90) != capped
    assert _catalog.softmax_config("fwd", 1024, 4, 90) != capped
    assert _catalog.softmax_config("bwd", 131072, 2, 90) == clustered
    assert _catalog.softmax_config("bwd", 131072, 2, 80).cluster == 1  # no clusters before sm_90
    monkeypatch.setattr(_catalog, "CE_FWD_RULES", ((2, 0, 1 << 20, capped),))
    assert _catalog.ce_fwd_config(8192, 32000, 2, 90, 132) == capped
    assert _catalog.ce_fwd_config(8192, 32000, 4, 90, 132) != capped


def test_heuristics_leave_rule_only_configs_to_rules(monkeypatch):
    for _, _, _, _, cfg in _catalog.SOFTMAX_RULES:
        assert cfg in _catalog.SOFTMAX_CONFIGS + _catalog.SOFTMAX_RULE_CONFIGS  # compiled
    monkeypatch.setattr(_catalog, "SOFTMAX_RULES", ())
    for direction in ("fwd", "bwd"):
        for elem in (4, 2):
            for cols in (1, 256, 1000, 1024, 2048, 4096, 16384, 32768, 131072, 262144):
                assert _catalog.softmax_config(direction, cols, elem, 90) not in _catalog.SOFTMAX_RULE_CONFIGS


def test_every_backward_config_is_compiled():
    for ctype in _catalog.CUDA_TYPES:
        expressions = _catalog.expressions("cross_entropy.cu", ctype, 80)
        for cfg in _catalog.CE_BWD_CONFIGS:
            assert _catalog.ce_bwd_kernel(ctype, "int", cfg) in expressions
    assert _catalog.CE_BWD_CONFIG in _catalog.CE_BWD_CONFIGS


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", _catalog.SOFTMAX_RULE_CONFIGS, ids=str)
def test_softmax_rule_only_configs_match_float64(cfg, dtype, monkeypatch):
    """Each configuration only a rule selects, on 5 rows (row groups past the last row with ROWS > 5, which must
    write nothing: the rows after the outputs hold a sentinel), one tile and two and a bit."""
    softmax, _, _ = _kernels()
    for paths_before_rules in ("STAGED_WARP_COLUMNS", "STAGED_BLOCK_COLUMNS", "SPLIT_MIN_COLUMNS"):
        monkeypatch.setattr(_catalog, paths_before_rules, {})
    rows = 5
    for cols in (cfg.capacity(dtype.itemsize), 2 * cfg.capacity(dtype.itemsize) + 3):
        monkeypatch.setattr(_catalog, "SOFTMAX_RULES", tuple((d, dtype.itemsize, 0, cols, cfg) for d in ("fwd", "bwd")))
        x = torch.randn(rows, cols, device=_device()).mul(4).to(dtype)
        dy = torch.randn_like(x)
        outputs = torch.full((2, rows + 3, cols), 7.0, device=_device()).to(dtype)
        y, dx = outputs[0, :rows], outputs[1, :rows]
        softmax.forward(x, y, False)
        check(y, torch.softmax(x.double(), -1), dtype, f"forward {cols}")
        softmax.backward(y, dy, dx, False)
        y64, dy64 = y.double(), dy.double()
        check(dx, y64 * (dy64 - (y64 * dy64).sum(-1, True)), dtype, f"backward {cols}")
        assert (outputs[:, rows:] == 7).all(), "written past the last row"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", _catalog.CE_BWD_CONFIGS, ids=str)
def test_cross_entropy_backward_configs_and_row_orders(cfg, dtype, monkeypatch):
    _, cross_entropy, _ = _kernels()
    monkeypatch.setattr(_catalog, "CE_BWD_CONFIG", cfg)
    rows = 7
    for classes in (20011, 20480):  # element-wise and 16-byte vector loads
        logits = torch.randn(rows, classes, device=_device()).to(dtype)
        target = torch.randint(0, classes, (rows,), device=_device())
        target[2] = -100
        loss = torch.empty(rows, device=_device())
        lse = torch.empty(rows, device=_device())
        cross_entropy.forward(logits, target, None, loss, lse, torch.empty_like(lse), -100, 0.0)
        _, _, ref_grad = ce_reference(logits, target, None, -100, 0.0)
        grad_loss = torch.rand(rows, device=_device())
        expected = ref_grad * grad_loss.double()[:, None]
        for last_row_first in (True, False):
            monkeypatch.setattr(cross_entropy, "BACKWARD_LAST_ROW_FIRST", last_row_first)
            grad = torch.empty_like(logits)
            cross_entropy.backward(logits, target, None, None, lse, grad_loss, grad, -100, 0.0)
            check(grad, expected, dtype, f"gradient, {classes} classes, last row first={last_row_first}")


@gpu
@pytest.mark.parametrize("cfg", _catalog.CE_FWD_CONFIGS, ids=str)
def test_cross_entropy_forward_configs(cfg, monkeypatch):
    _, cross_entropy, _ = _kernels()
    if cfg.cluster > 1 and torch.cuda.get_device_capability(_device())[0] < 9:
        pytest.skip("clusters need sm_90")
    monkeypatch.setattr(_catalog, "CE_FWD_RULES", ((2, 0, 1 << 40, cfg),))
    rows, classes = 6, 3 * cfg.capacity(2) + 5
    logits = torch.randn(rows, classes, device=_device()).to(torch.bfloat16)
    target = torch.randint(0, classes, (rows,), device=_device())
    loss = torch.empty(rows, device=_device())
    lse = torch.empty(rows, device=_device())
    cross_entropy.forward(logits, target, None, loss, lse, torch.empty_like(lse), -100, 0.1)
    ref_loss, ref_lse, _ = ce_reference(logits, target, None, -100, 0.1)
    check(loss, ref_loss, torch.float32, "loss")
    check(lse, ref_lse, torch.float32, "lse")
