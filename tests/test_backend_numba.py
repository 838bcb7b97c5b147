"""numba backend specifics: bfloat16 and float16 bit conversions, vector widths, the numpy 2.5 workaround, the
modules' import order, launching on torch's current (non-default) stream, each softmax path (forced through the
_tuning tables), block-sparse rows of several tiles and lanes and their stash in shared memory. Cross-entropy's
kernels: test_backend_numba_cross_entropy.py."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import multisoft_numba
from harness import DEVICE, ON_GPU, assert_close
from multisoft import LossOptions
from multisoft.check import (reference_blocksparse, reference_blocksparse_backward, reference_softmax,
                             reference_softmax_backward, softmax_backward_magnitude)

SIMULATED = multisoft_numba.simulated()
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None

needs_numba = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")
needs_backend = pytest.mark.skipif(not HAVE_NUMBA_CUDA or not (ON_GPU or SIMULATED),
                                   reason="needs a CUDA device or the simulator (NUMBA_ENABLE_CUDASIM=1)")
host_callable_helpers = pytest.mark.skipif(not SIMULATED or not HAVE_NUMBA_CUDA,
                                           reason="the device helpers are host-callable only under the simulator")
needs_gpu = pytest.mark.skipif(not HAVE_NUMBA_CUDA or not ON_GPU or SIMULATED, reason="needs a CUDA device")


def _bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in t.view(torch.int16).tolist()]


def _tricky_floats() -> torch.Tensor:
    """float32 values around bfloat16 rounding: exact ties (odd and even), just off ties, extremes."""
    specials = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38,
                1e-40, -1e-40, 1.1754944e-38, 65504.0, 1.0 / 3.0]
    words = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,
             0x00008000, 0x00018000, 0x80008000, 0x4049FFFF, 0x40498000]
    from_words = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    values = torch.cat([torch.tensor(specials, dtype=torch.float32), from_words.view(torch.float32),
                        torch.randn(2000) * torch.logspace(-30, 30, 2000)])
    return values


@host_callable_helpers
def test_bf16_round_to_nearest_even_matches_torch():
    from multisoft_numba._device import bf16_bits_to_float, float_to_bf16_bits
    values = _tricky_floats()
    expected = _bits(values.to(torch.bfloat16))
    got = [int(float_to_bf16_bits(v)) & 0xFFFF for v in values.numpy()]
    mismatches = [(float(v), hex(g), hex(e)) for v, g, e in zip(values.tolist(), got, expected) if g != e]
    assert not mismatches, mismatches[:5]
    back = torch.tensor([float(bf16_bits_to_float(b)) for b in values.to(torch.bfloat16).view(torch.int16).numpy()])
    assert torch.equal(back, values.to(torch.bfloat16).float())


@host_callable_helpers
def test_bf16_nan_stays_nan_with_sign():
    from multisoft_numba._device import float_to_bf16_bits
    for word in (0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF):
        signed = word - (1 << 32) if word >= 1 << 31 else word
        value = torch.tensor([signed], dtype=torch.int32).view(torch.float32).numpy()[0]
        bits = int(float_to_bf16_bits(value)) & 0xFFFF
        assert bits & 0x7F80 == 0x7F80 and bits & 0x007F, hex(bits)   # exponent all ones, mantissa non-zero
        assert bits >> 15 == word >> 31


@host_callable_helpers
def test_float16_bits_round_trip_like_torch():
    from multisoft_numba._intrinsics import float_to_half_bits, half_bits_to_float
    values = torch.cat([_tricky_floats(), torch.tensor([1e-6, 7e-8, 65519.0, 65520.0, -7e-8])])
    expected = _bits(values.to(torch.float16))
    got = [int(float_to_half_bits(v)) & 0xFFFF for v in values.numpy()]
    mismatches = [(float(v), hex(g), hex(e)) for v, g, e in zip(values.tolist(), got, expected) if g != e]
    assert not mismatches, mismatches[:5]
    assert int(float_to_half_bits(float("nan"))) & 0x7FFF > 0x7C00      # NaN stays NaN
    halves = values.to(torch.float16)
    back = torch.tensor([float(half_bits_to_float(b)) for b in halves.view(torch.int16).numpy()])
    assert torch.equal(back, halves.float())


def _shifted_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a tensor whose data starts one element past an aligned address."""
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return shifted.copy_(t)


def _assert_softmax_backward(dx, y, dy, log, dtype, what):
    """dx against the float64 backward of the forward's output y, at the size of the terms it is a difference of."""
    magnitude = softmax_backward_magnitude(y, dy, -1, log)
    assert_close(dx, reference_softmax_backward(y, dy, -1, log), dtype, what, magnitude)


def test_simulated_follows_the_environment(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert multisoft_numba.simulated() is True
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    assert multisoft_numba.simulated() is False
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM")
    assert multisoft_numba.simulated() is False
    assert multisoft_numba.DTYPES == (torch.float32, torch.float16, torch.bfloat16)


# Each module of the backend imports only modules before it here (the layer order of the backend layout).
IMPORT_ORDER = ("__init__", "_tuning", "_launch", "_intrinsics", "_device", "_softmax_rows", "_softmax_split",
                "_blocksparse_rows", "_blocksparse_float", "_blocksparse_packed", "_cross_entropy_probabilities",
                "softmax", "cross_entropy", "log_probs", "blocksparse")


def test_modules_import_only_the_layers_below_them():
    """No import cycle: every import of a module of the package names one earlier in IMPORT_ORDER, which lists
    every module the package has."""
    package = pathlib.Path(multisoft_numba.__file__).parent
    modules = {path.stem for path in package.glob("*.py")}
    assert modules == set(IMPORT_ORDER), modules ^ set(IMPORT_ORDER)
    for name in IMPORT_ORDER:
        tree = ast.parse((package / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else ["__init__" if a.name not in modules else a.name
                                                             for a in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                targets = [n.split(".", 1)[1] if "." in n else "__init__" for n in names
                           if n and n.split(".")[0] == "multisoft_numba"]
            else:
                continue
            for target in targets:
                assert IMPORT_ORDER.index(target) < IMPORT_ORDER.index(name), f"{name} imports {target}"


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_vector_widths_agree_with_float64(dtype):
    """Aligned rows go in 16-byte vectors; rows at an odd element offset one element at a time: both agree with
    the float64 references (softmax and log_softmax forward and backward)."""
    from multisoft_numba import softmax
    from multisoft_numba._launch import vector_views
    rows, n = 3, 64
    aligned = (torch.randn(rows, n, device=DEVICE) * 3).to(dtype)
    aligned[1, 5] = float("-inf")
    dy = torch.randn(rows, n, device=DEVICE).to(dtype)
    for x in (aligned, _shifted_copy(aligned)):
        layout = "aligned" if x is aligned else "unaligned"
        assert vector_views((x,))[1] == (16 // x.element_size() if x is aligned else 1)
        for log in (False, True):
            out, dx = torch.empty_like(x), torch.empty_like(x)
            softmax.forward(x, out, log)
            assert_close(out, reference_softmax(x, -1, log), dtype, f"{layout} forward log={log}")
            y = out if x is aligned else _shifted_copy(out)
            softmax.backward(y, dy, dx, log)
            _assert_softmax_backward(dx, y, dy, log, dtype, f"{layout} backward log={log}")


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_rows_every_group_size_and_nothing_past_the_last_row(dtype):
    """Short rows share blocks, a group of threads each (ROW_GROUP_MAX): every group size, row counts that
    leave groups past the last row (they must write nothing: the rows after the output hold a sentinel), a row
    of -inf only; forward and backward against float64."""
    from multisoft_numba import _tuning, softmax
    from multisoft_numba._launch import vector_views
    groups = set()
    for n in (1, 3, 16, 40, 130, 256):
        for rows in (1, 5):
            x = (torch.randn(rows, n, device=DEVICE) * 3).to(dtype)
            if rows > 1:
                x[-1] = float("-inf")
            dy = torch.randn(rows, n, device=DEVICE).to(dtype)
            for log in (False, True):
                for direction in ("forward", "backward"):
                    buffer = torch.full((rows + 8, n), 7.0, device=DEVICE).to(dtype)
                    got = buffer[:rows]
                    held = softmax._held_bytes(*vector_views((x, got))[:2])
                    plan = (softmax._forward_plan if direction == "forward" else softmax._backward_plan)(
                        n, held, got.device)
                    assert plan.path == "cached" and plan.group <= _tuning.ROW_GROUP_MAX[direction], plan
                    groups.add(plan.group)
                    if direction == "forward":
                        softmax.forward(x, got, log)
                        expected = reference_softmax(x, -1, log)
                    else:
                        y = reference_softmax(x, -1, log).to(dtype)
                        softmax.backward(y, dy, got, log)
                        expected = reference_softmax_backward(y, dy, -1, log)
                    assert torch.equal(buffer[rows:], torch.full_like(buffer[rows:], 7.0)), "written past the rows"
                    finite = torch.isfinite(expected).all(dim=1)
                    assert_close(got[finite], expected[finite], dtype, f"{direction} {plan} n={n} log={log}")
    assert len(groups - {0}) >= 3, groups  # several group sizes ran


@needs_numba
def test_row_stack_workaround_in_a_fresh_interpreter():
    """numpy without row_stack (numpy >= 2.5): numba-cuda's array module imports, numpy is left as it was."""
    code = (
        "import numpy\n"
        "if hasattr(numpy, 'row_stack'):\n"
        "    del numpy.row_stack\n"
        "import multisoft_numba._launch as glue, sys\n"
        "assert glue.ROW_STACK_MISSING\n"
        "assert 'numba.cuda.np.arrayobj' in sys.modules\n"
        "assert not hasattr(numpy, 'row_stack')\n"
        "import multisoft_numba\n"
        "assert any('row_stack' in line for line in multisoft_numba.notes())\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@needs_gpu
def test_launches_on_the_current_non_default_stream():
    """A slow producer and a consumer on a side stream: numba must run between them, on that stream."""
    from multisoft_numba import cross_entropy, softmax
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            a = torch.randn(4096, 4096, device=DEVICE)
            x = (a @ a).view(512, -1) * 1e-3
            out = torch.empty_like(x)
            softmax.forward(x, out, log=False)
            expected = reference_softmax(x, -1, False)
            long_rows = (a @ a).view(64, -1) * 1e-3          # the looping path
            long_out = torch.empty_like(long_rows)
            softmax.forward(long_rows, long_out, log=True)
            long_expected = reference_softmax(long_rows, -1, True)
            target = torch.randint(0, 32000, (512,), device=DEVICE)
            logits = (a @ a).view(512, -1)[:, :32000].contiguous() * 1e-3
            loss, lse = torch.empty(512, device=DEVICE), torch.empty(512, device=DEVICE)
            cross_entropy.forward(logits, target, None, loss, lse, torch.empty_like(lse), None, None,
                                  LossOptions(ignore_index=-100, label_smoothing=0.0, softcap=0.0,
                                              lse_square_scale=0.0))
            loss_expected = torch.nn.functional.cross_entropy(logits.double(), target, reduction="none")
            side.synchronize()
            assert_close(out, expected, torch.float32, "softmax on a side stream")
            assert_close(long_out, long_expected, torch.float32, "long-row log_softmax on a side stream")
            assert_close(loss, loss_expected, torch.float32, "cross_entropy on a side stream")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["split", "looping"])
def test_long_row_paths_with_a_masked_part(dtype, path, monkeypatch):
    """Rows of 262144 with a run of -inf over whole parts, and a row of -inf only, on the split path (the forward's
    parts of SPLIT_FORWARD, the backward at each choice of SPLIT_BWD) or the looping path (MAX_PARTS 0: no row
    splits)."""
    from multisoft_numba import _tuning, softmax
    from multisoft_numba._launch import device_index
    n = 262_144
    x = (torch.randn(3, n, device=DEVICE) * 3).to(dtype)
    x[0, 40_000:80_000] = float("-inf")     # covers whole parts of the split path
    x[2] = float("-inf")
    held = 2 if x.element_size() == 2 else 4   # rows of 262144 are read in pairs: 16-bit rows are held packed
    if path == "looping":
        monkeypatch.setattr(_tuning, "MAX_PARTS", {4: 0, 2: 0})
    else:
        max_parts = softmax._max_parts(device_index(x.device), held)
        for threads, cache, _ in (*_tuning.SPLIT_FORWARD[held], *_tuning.SPLIT_BWD[held]):
            if -(-n // (threads * cache)) > max_parts:
                pytest.skip(f"{-(-n // (threads * cache))} parts could not all be resident on this GPU")
    backward_choices = _tuning.SPLIT_BWD[held] if path == "split" else _tuning.SPLIT_BWD[held][:1]
    for log in (False, True):
        assert softmax._forward_plan(n, held, x.device).path == path
        out = torch.empty_like(x)
        softmax.forward(x, out, log)
        assert_close(out, reference_softmax(x, -1, log), dtype, f"{path} forward log={log}")
        y = out[:2].contiguous()
        dy = torch.randn_like(y)
        for choice in backward_choices:
            monkeypatch.setattr(_tuning, "SPLIT_BWD", {**_tuning.SPLIT_BWD, held: (choice,)})
            plan = softmax._backward_plan(n, held, x.device)
            assert plan.path == path and (path == "looping" or (plan.threads, plan.cache, plan.blocks) == choice), plan
            dx = torch.empty_like(y)
            softmax.backward(y, dy, dx, log)
            _assert_softmax_backward(dx, y, dy, log, dtype, f"{path} backward {plan}")


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_looping_path_on_rows_of_several_steps(dtype, monkeypatch):
    """Rows that neither fit a block (CACHE, CACHE_BWD empty) nor split (MAX_PARTS 0) loop: several steps of UNROLL
    elements a thread, a ragged end, a row of -inf only, a NaN, every third entry -inf; forward and backward against
    float64."""
    from multisoft_numba import _tuning, softmax
    from multisoft_numba._launch import vector_views
    monkeypatch.setattr(_tuning, "CACHE", {4: (), 2: ()})
    monkeypatch.setattr(_tuning, "CACHE_BWD", {4: (), 2: ()})
    monkeypatch.setattr(_tuning, "MAX_PARTS", {4: 0, 2: 0})
    for n in (100, 37) if SIMULATED else (70_000, 4099):
        x = (torch.randn(4, n, device=DEVICE) * 4).to(dtype)
        x[1] = float("-inf")
        x[2, n // 3] = float("nan")
        x[3, 5::3] = float("-inf")
        held = softmax._held_bytes(*vector_views((x,))[:2])
        for plan in (softmax._forward_plan(n, held, x.device), softmax._backward_plan(n, held, x.device)):
            assert plan.path == "looping" and n > plan.threads * _tuning.UNROLL, plan   # more than one step a row
        for log in (False, True):
            out = torch.empty_like(x)
            softmax.forward(x, out, log)
            assert_close(out, reference_softmax(x, -1, log), dtype, f"looping forward n={n} log={log}")
            y = out[[0, 3]].contiguous()
            dy = torch.randn_like(y)
            dx = torch.empty_like(y)
            softmax.backward(y, dy, dx, log)
            _assert_softmax_backward(dx, y, dy, log, dtype, f"looping backward n={n} log={log}")


@needs_numba
def test_split_plans_carry_their_launch_bounds(monkeypatch):
    """The split plans of a (stand-in) 132-multiprocessor GPU: float32 forward parts of SPLIT_FORWARD, compiled for its
    blocks a multiprocessor, the 16-bit ones and the wide parts of rows of 1048576 under the 1024-thread bound (None),
    the backward's for their block size."""
    from multisoft_numba import _tuning, softmax
    monkeypatch.setattr(softmax, "SIMULATOR", False)
    monkeypatch.setattr(softmax, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(softmax, "device_index", lambda device: 0)
    gpu = torch.device("cuda", 0)
    for held in (4, 2):
        threads, cache, blocks = _tuning.SPLIT_FORWARD[held][0]
        for n in (131_072, 262_144):
            plan = softmax._forward_plan(n, held, gpu)
            assert plan == ("split", threads, -(-n // (threads * cache)), cache, 0, blocks), plan
            assert plan.bound == ((threads, blocks) if blocks else None)
        threads, cache, blocks = _tuning.SPLIT_BWD[held][-1]
        plan = softmax._backward_plan(262_144, held, gpu)
        assert plan.path == "split" and plan.bound == (plan.threads, blocks), plan
    assert _tuning.SPLIT_FORWARD[4][0][2] > 0   # the float32 forward's parts are compiled for several blocks
    wide = softmax._forward_plan(1 << 20, 4, gpu)
    assert (wide.path, wide.threads, wide.cache, wide.bound) == ("split", *_tuning.SPLIT_WIDE["forward"][4][:2], None)
    assert softmax.Plan("split", 256, 4, 64).bound is None   # no blocks given: the 1024-thread bound


@needs_gpu
def test_rows_too_long_for_the_split_choices_take_wide_parts():
    """Rows of 1048576: too many parts for the regular split choices (on a GPU of 132 multiprocessors or fewer),
    so the parts of SPLIT_WIDE, which are checked against float64 by the agreement harness."""
    from multisoft_numba import _tuning, softmax
    from multisoft_numba._launch import device_index
    device = torch.device(DEVICE)
    half_sms = torch.cuda.get_device_properties(device).multi_processor_count // 2
    n = 1 << 20
    checked = 0
    for direction, held, caches, splits in (("backward", 4, _tuning.CACHE_BWD[4], _tuning.SPLIT_BWD[4]),
                                            ("backward", 2, _tuning.CACHE_BWD[2], _tuning.SPLIT_BWD[2]),
                                            ("forward", 4, _tuning.CACHE[4], _tuning.SPLIT_FORWARD[4]),
                                            ("forward", 2, _tuning.CACHE[2], _tuning.SPLIT_FORWARD[2])):
        if all(-(-n // (threads * cache)) <= half_sms for threads, cache, _ in splits):
            continue   # this GPU fits the regular parts
        checked += 1
        wide = _tuning.SPLIT_WIDE[direction][held]
        plan = softmax._plan(n, caches, splits, held, device, 0, wide)
        wide_parts = -(-n // (wide[0] * wide[1]))
        expected = "split" if wide_parts <= softmax._max_parts(device_index(device), held) else "looping"
        assert plan.path == expected, plan
        if expected == "split":
            assert (plan.threads, plan.parts, plan.cache, plan.blocks) == (wide[0], wide_parts, *wide[1:]), plan
    if not checked:
        pytest.skip("this GPU fits the regular parts of every choice")


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_forward_of_persistent_blocks_that_prefetch_rows(dtype, monkeypatch):
    """The forward of 16-bit rows held as words, a block a row, as persistent blocks that read their next row
    before they write the current one (path 'prefetch', from PREFETCH_FROM elements): more rows than blocks, rows in
    vectors of 8 and of 2, ragged ends, a row of -inf only, a NaN, every third entry -inf; on a GPU also the plan
    rows of 32768 take by default."""
    from multisoft_numba import _tuning, softmax

    gpu = ON_GPU and not SIMULATED
    if gpu:
        assert softmax._forward_plan(32768, 2, torch.device(DEVICE)) == ("prefetch", 1024, 1, 32, 0, 0)
    monkeypatch.setattr(_tuning, "CACHE", {**_tuning.CACHE, 2: (32 if gpu else 8,)})
    monkeypatch.setattr(_tuning, "ROW_GROUP_MAX", {**_tuning.ROW_GROUP_MAX, "forward": 0})
    monkeypatch.setattr(_tuning, "PREFETCH_FROM", {2: 0})
    for rows, n in ((1000, 32768), (300, 20002)) if gpu else ((5, 64), (7, 42)):
        x = (torch.randn(rows, n, device=DEVICE) * 4).to(dtype)
        x[1] = float("-inf")
        x[2, n // 3] = float("nan")
        x[3, 5::3] = float("-inf")
        plan = softmax._forward_plan(n, 2, x.device)
        assert plan.path == "prefetch", plan
        for log in (False, True):
            out = torch.empty_like(x)
            softmax.forward(x, out, log)
            assert_close(out, reference_softmax(x, -1, log), dtype, f"{plan} {rows}x{n} log={log}")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_16bit_rows_on_every_path_and_cache(dtype, monkeypatch):
    """16-bit rows held as words (PACK_16BIT): the cached path (CACHE, CACHE_BWD) and the split path (SPLIT_FORWARD,
    SPLIT_BWD: 256-thread parts) at several elements per thread, rows in vectors of 8 and of 2, ragged ends, a row of
    -inf only, a NaN, every third entry -inf; forward and backward against float64."""
    from multisoft_numba import _tuning, softmax
    from multisoft_numba._launch import device_index, threads_for, vector_views

    monkeypatch.setattr(_tuning, "ROW_GROUP_MAX", {"forward": 0, "backward": 0})
    monkeypatch.setattr(_tuning, "PREFETCH_FROM", {})
    max_parts = softmax._max_parts(device_index(torch.device(DEVICE)), 2)
    checked = 0
    for n in (1002, 4104, 32768, 70000):
        x = (torch.randn(4, n, device=DEVICE) * 4).to(dtype)
        x[1] = float("-inf")
        x[2, n // 3] = float("nan")
        x[3, 5::3] = float("-inf")
        assert vector_views((x,))[1] == (2 if n == 1002 else 8)
        for path, cache in (("cached", 8), ("cached", 32), ("cached", 64), ("split", 16), ("split", 32),
                            ("split", 64)):
            if path == "cached":
                threads, parts = min(threads_for(n, cache), 1024), 1
                if n > threads * cache:
                    continue
                forward_plan = backward_plan = ("cached", threads, 1, cache, 0, 0)
                tables = {"CACHE": {2: (cache,)}, "CACHE_BWD": {2: (cache,)}}
            else:
                threads = 256
                parts = -(-n // (threads * cache))
                if parts > max_parts:
                    continue
                forward_plan = ("split", threads, parts, cache, 0, 0)
                backward_plan = ("split", threads, parts, cache, 0, 1)   # compiled for one block a multiprocessor
                tables = {"CACHE": {2: ()}, "CACHE_BWD": {2: ()}, "SPLIT_FORWARD": {2: ((threads, cache, 0),)},
                          "SPLIT_BWD": {2: ((threads, cache, 1),)}}
            for name, table in tables.items():
                monkeypatch.setattr(_tuning, name, {**getattr(_tuning, name), **table})
            assert softmax._forward_plan(n, 2, x.device) == forward_plan
            assert softmax._backward_plan(n, 2, x.device) == backward_plan
            for log in (False, True):
                out = torch.empty_like(x)
                softmax.forward(x, out, log)
                assert_close(out, reference_softmax(x, -1, log), dtype, f"forward {forward_plan} n={n} log={log}")
                dy = torch.randn_like(x)
                dx = torch.empty_like(x)
                softmax.backward(out, dy, dx, log)
                _assert_softmax_backward(dx, out, dy, log, dtype, f"backward {backward_plan} n={n} log={log}")
                checked += 1
    assert checked >= 30


def test_blocksparse_values_per_lane_follow_the_mean_row(monkeypatch):
    """On a GPU, a warp a row (ROW_LANE_BYTES None), the first choice whose tile (32 lanes) holds the layout's mean
    row: float32 backward rows of 1040
    elements on average take 32 values per lane (16 hold 512), rows of 467 take 16, the forward 16. 16-bit rows
    read in pairs are held as words: the forward 48 values for rows of 1040 (32 hold 1024), 16 for 467, 64 for
    rows longer than any choice holds; when causal 16 for 467, else 32; the backward the most whose tile the mean
    row fills (32 for 1040, 64 for 2100, 16 for 467). The forward with a scale that is not positive, and rows read
    one element at a time, take the floats."""
    from multisoft_numba import _tuning, blocksparse

    monkeypatch.setattr(blocksparse, "SIMULATOR", False)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_ROW_LANE_BYTES", {"forward": None, "backward": None})

    def shape(*args, **kwargs):
        """Values per lane, forward and backward."""
        return tuple(blocksparse._launch_shape(*args, direction, **kwargs)[3]
                     for direction in ("forward", "backward"))

    assert shape(1, 4096, 1040.0, 4, 4, 64) == (16, 32)
    assert shape(1, 4096, 467.0, 4, 4, 64) == (16, 16)
    assert shape(1, 4096, 1040.0, 8, 2, 64) == (48, 32)
    assert shape(1, 4096, 1040.0, 8, 2, 64, causal=True) == (32, 32)
    assert shape(1, 4096, 2100.0, 8, 2, 64) == (64, 64)
    assert shape(1, 4096, 467.0, 8, 2, 64) == (16, 16)
    assert shape(1, 4096, 467.0, 8, 2, 64, causal=True) == (16, 16)
    assert shape(1, 4096, 2100.0, 8, 2, 64, causal=True) == (32, 64)
    assert shape(1, 4096, 1040.0, 8, 2, 64, positive_scale=False) == (16, 32)
    assert shape(1, 4096, 1040.0, 1, 2, 64) == (16, 16)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_PACK_16BIT", False)
    assert shape(1, 4096, 1040.0, 8, 2, 64) == (16, 16)


def test_blocksparse_lanes_per_row_follow_the_mean_row(monkeypatch):
    """On a GPU, a row takes the power of two of lanes nearest its mean bytes over ROW_LANE_BYTES of its direction
    (None: 32), at most 32 and at least 32 / B (a warp's rows within one block-row); WARPS warps a block; the
    values per lane chosen for the tile of those lanes."""
    from multisoft_numba import _tuning, blocksparse

    monkeypatch.setattr(blocksparse, "SIMULATOR", False)
    warps = _tuning.BLOCKSPARSE_WARPS

    def shape(*args):
        return blocksparse._launch_shape(*args, "forward")

    monkeypatch.setattr(_tuning, "BLOCKSPARSE_ROW_LANE_BYTES", {"forward": None, "backward": 64})
    assert shape(1, 4096, 460.0, 8, 2, 64)[:2] == (32, warps)
    assert blocksparse._launch_shape(1, 4096, 460.0, 8, 2, 64, "backward")[:2] == (16, warps * 2)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_ROW_LANE_BYTES", {"forward": 128, "backward": None})
    assert shape(1, 4096, 460.0, 8, 2, 64)[:2] == (8, warps * 4)       # 920 bytes: 7.2 lanes
    assert shape(1, 4096, 460.0, 8, 2, 64)[3] == 64                     # 8 x 64 hold 460
    assert shape(1, 4096, 460.0, 4, 4, 64)[:2] == (16, warps * 2)       # 14.4
    assert shape(1, 4096, 1 << 20, 4, 4, 64)[0] == 32
    assert shape(1, 4096, 16.0, 8, 2, 16)[0] == 2 and shape(1, 4096, 16.0, 8, 2, 128)[0] == 1
    assert blocksparse._launch_shape(1, 4096, 460.0, 8, 2, 64, "backward")[0] == 32
    lanes, rows, grid, _ = shape(1, 4096, 460.0, 8, 2, 64)
    assert grid[0] == -(-4096 // rows)


# Small tiles for the simulator: 4 lanes a row (their pairs merged), 2 values a lane, grid-stride over the rows.
SMALL_TILES = {"BLOCKSPARSE_SIMULATOR_LANES": 4, "BLOCKSPARSE_SIMULATOR_FLOATS": 2, "BLOCKSPARSE_SIMULATOR_GRID": 3,
               "BLOCKSPARSE_FORWARD_FLOATS": {4: (2,), 2: (2,)}, "BLOCKSPARSE_BACKWARD_FLOATS": {4: (2,), 2: (2,)},
               "BLOCKSPARSE_MAX_GRID": 3, "BLOCKSPARSE_MAX_GRID_Y": 1}


@needs_backend
@pytest.mark.parametrize("row_lane_bytes", [None, 40, 1e9], ids=["warp", "lanes40", "fewest"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "bfloat16-unaligned"],
                         ids=str)
def test_blocksparse_lanes_tiles_and_masked_rows(monkeypatch, dtype, is_causal, row_lane_bytes):
    """Rows of several tiles reduced over several lanes, grid-stride, empty and fully masked rows; on a GPU a
    warp a row or several rows a warp (ROW_LANE_BYTES; the fewest lanes a row: 2, 16 rows a warp)."""
    from multisoft._blocksparse import lookup_table
    from multisoft_numba import _tuning, blocksparse
    if row_lane_bytes is not None and not ON_GPU:
        pytest.skip("the simulator runs a row a block")
    for name, value in {**SMALL_TILES, "BLOCKSPARSE_ROW_LANE_BYTES": {"forward": row_lane_bytes,
                                                                      "backward": row_lane_bytes}}.items():
        monkeypatch.setattr(_tuning, name, value)
    unaligned = dtype == "bfloat16-unaligned"
    dtype = torch.bfloat16 if unaligned else dtype
    block, scale = 16, 0.7
    layout = (torch.rand(2, 3, 5) < 0.6).long()
    layout[:, :, 0] = 1
    layout[0, 1] = 0                  # a block-row with no blocks
    layout[1, 1] = 0
    layout[1, 1, 3:] = 1              # only above the diagonal: fully masked when causal
    layout[1, 2, 2] = 0               # no diagonal block
    lut = lookup_table(layout, block, DEVICE)
    x = (torch.randn(2, lut.nnz, block, block, device=DEVICE) * 3).to(dtype)
    x[1, 0, 5] = float("-inf")        # a row of the first block-row with every element -inf
    if unaligned:
        x = _shifted_copy(x)
    out = torch.empty_like(x)
    blocksparse.forward(x, out, lut, scale, is_causal)
    assert_close(out, reference_blocksparse(x, layout, block, scale, is_causal), dtype, "forward")
    if unaligned:
        out = _shifted_copy(out)
    dy = torch.randn_like(out)
    dx = torch.empty_like(out)
    blocksparse.backward(out, dy, dx, lut, scale)
    expected, magnitude = reference_blocksparse_backward(out, dy, layout, block, scale)
    assert_close(dx, expected, dtype, "backward", magnitude)


@needs_numba
def test_blocksparse_stash_holds_the_row_it_is_sized_for(monkeypatch):
    """Tiles kept: all but the last of the layout's mean row, at most STASH_BYTES a block; none for rows of one
    tile."""
    from types import SimpleNamespace

    from multisoft_numba import _tuning, blocksparse
    lut = SimpleNamespace(block=64, mean_blocks=2067 / 64, max_blocks=44)   # the bench's 50 % layout
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STASH_BYTES", 48 * 1024)
    assert blocksparse._stash_tiles(lut, 16, 32, 4, 4) == 4      # rows of 2067 span 5 tiles of 512
    assert blocksparse._stash_tiles(lut, 16, 32, 4, 8) == 3      # 3 tiles of y and dy fill 48 KiB
    assert blocksparse._stash_tiles(lut, 64, 32, 4, 4) == 1      # 2 tiles of 2048
    assert blocksparse._stash_tiles(SimpleNamespace(block=64, mean_blocks=7.5, max_blocks=16), 16, 32, 4, 4) == 0
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STASH_BYTES", 24 * 1024)
    assert blocksparse._stash_tiles(lut, 16, 32, 4, 4) == 3      # 3 tiles of 4 warps' rows fill 24 KiB


def _spy_on_launches(monkeypatch, module, launched):
    """Record (the last kernel argument, the bytes of dynamic shared memory) of each launch of `module`."""
    original = module.launch

    def spy(kernel_, grid, threads, args, shared=0):
        launched.append((int(args[-1]), shared))
        return original(kernel_, grid, threads, args, shared=shared)

    monkeypatch.setattr(module, "launch", spy)


@needs_backend
@pytest.mark.parametrize("kept", ["one", "all"])
@pytest.mark.parametrize("dtype, is_causal", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["float32-full", "float32-causal", "bfloat16-causal"])
def test_blocksparse_rows_keep_tiles_in_shared_memory(monkeypatch, dtype, is_causal, kept):
    """Rows of several tiles: the second pass takes one, or all but the last, of the mean row's tiles from shared
    memory, where the first pass kept them, and reads the others again (the longer rows' last ones): the forward
    (floats, or 16-bit words; the count passed at launch) and the float backward (y and dy; the count compiled
    in)."""
    from multisoft._blocksparse import lookup_table
    from multisoft_numba import _tuning, blocksparse
    tables = {**SMALL_TILES, "BLOCKSPARSE_PACKED_VALUES": {"forward": (4,), "causal": (4,), "backward": (4,)}}
    for name, value in tables.items():
        monkeypatch.setattr(_tuning, name, value)
    block, scale = 16, 0.7
    columns = 64 if ON_GPU else 12    # rows of at least 3 tiles: 32 lanes on a GPU, 4 under the simulator
    layout = (torch.arange(columns) % 4 != 3).long().repeat(2, 2, 1)   # 3 blocks of every 4
    layout[0, 1] = 0                  # a block-row with no blocks
    layout[1, 1, 1] = 0               # no diagonal block
    layout[1, 0, 3:] = 1              # a row longer than the mean
    lut = lookup_table(layout, block, DEVICE)
    x = (torch.randn(2, lut.nnz, block, block, device=DEVICE) * 3).to(dtype)
    x[1, 0, 5] = float("-inf")        # a row of the first block-row with every element -inf
    out = torch.empty_like(x)
    packed = dtype != torch.float32

    def stash_for(direction, size):
        """STASH_BYTES for the `kept` tiles of the `direction` kernel (its values a lane), and those tiles."""
        lanes, rows, _, values = blocksparse._common((x, out), lut, direction, True, is_causal)[3]
        tiles = math.ceil(lut.mean_blocks * block / (lanes * values))
        assert tiles >= 3, "the mean row must have tiles kept and tiles read again"
        assert lut.max_blocks * block > tiles * lanes * values, "a row must have tiles past the mean row's"
        stash = {"one": 1, "all": tiles - 1}[kept]
        return stash * rows * lanes * values * size, stash

    stash_bytes, stash = stash_for("forward", 2 if packed else 4)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STASH_BYTES", stash_bytes)
    launched = []
    _spy_on_launches(monkeypatch, blocksparse, launched)
    blocksparse.forward(x, out, lut, scale, is_causal)
    assert launched == [(stash, stash_bytes)]
    assert_close(out, reference_blocksparse(x, layout, block, scale, is_causal), dtype, "forward")
    if packed:
        return
    dy = torch.randn_like(out)
    dx = torch.empty_like(out)
    stash_bytes, stash = stash_for("backward", 8)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_STASH_BYTES", stash_bytes)
    monkeypatch.setattr(_tuning, "BLOCKSPARSE_BACKWARD_STASH_TILES", stash)
    built = []
    original = blocksparse.backward_kernel
    monkeypatch.setattr(blocksparse, "backward_kernel", lambda *args: built.append(args[-1]) or original(*args))
    blocksparse.backward(out, dy, dx, lut, scale)
    assert built == [stash]
    expected, magnitude = reference_blocksparse_backward(out, dy, layout, block, scale)
    assert_close(dx, expected, dtype, "backward", magnitude)


@needs_numba
def test_launch_refuses_dynamic_shared_memory_past_48_kib():
    """More than 48 KiB of dynamic shared memory a block needs an opt-in that launch does not make: a clear error
    before anything is launched."""
    from multisoft_numba._launch import launch
    for shared in (-1, 48 * 1024 + 1):
        with pytest.raises(ValueError, match="shared"):
            launch(None, 1, 32, (), shared=shared)
