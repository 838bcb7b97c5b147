"""The benchmark's fused linear cross-entropy (``--ops linear_cross_entropy``): its plan, its float64 reference, a
run of tiny cases on the CPU with the torch backend, and its section of results.md."""

import argparse
import csv
import statistics
import time
import types

import pytest
import torch
import torch.nn.functional as F

from multisoft.bench import command, linear, linear_report, plan, records, report, run
from multisoft.bench.impls import Impl
from multisoft.bench.progress import Progress

TINY = (48, 32, 300)  # (M, H, V)


def test_the_op_is_asked_for_by_name_only():
    assert command.parse_args(["--ops", "lce"]).ops == ["linear_cross_entropy"]
    assert command.parse_args(["--ops", "softmax,linear_cross_entropy"]).ops == ["softmax", "linear_cross_entropy"]
    assert "linear_cross_entropy" not in command.parse_args([]).ops
    assert plan.plan_cases(["linear_cross_entropy"], quick=False) == {}


def test_the_cases():
    assert linear.cases(quick=False) == [(8192, 4096, 32000), (16384, 4096, 151936), (8192, 4096, 262144)]
    assert linear.cases(quick=True) == [(4096, 4096, 32000)]
    assert linear.shape_label((16384, 4096, 151936)) == "16384x4096x151936"
    # every case fits on a 139 GiB H200 in fp32 too, by the generous estimate
    assert max(linear.memory_needed(shape, "fp32") for shape in linear.SHAPES) < 100 * 2**30
    assert linear.memory_needed(linear.SHAPES[1], "bf16") < linear.memory_needed(linear.SHAPES[1], "fp32")


def test_a_case_too_big_for_the_gpu_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=16 * 2**30))
    needed = linear.memory_needed(linear.SHAPES[1], "fp32") / 2**30
    assert linear.too_big(linear.SHAPES[1], "fp32", torch.device("cuda")) == \
        f"skipped: needs about {needed:.0f} GiB, the GPU has 16 GiB"
    assert linear.too_big((1024, 512, 1000), "bf16", torch.device("cuda")) == ""
    assert linear.too_big(linear.SHAPES[1], "fp32", torch.device("cpu")) == ""


def test_the_reference_agrees_with_float64_autograd(monkeypatch):
    """Chunked over rows (4 rows a chunk here, the last one shorter), it gives the loss and both gradients of
    float64 F.linear then F.cross_entropy."""
    rows, hidden, classes = 10, 6, 7
    monkeypatch.setattr(linear, "REFERENCE_CHUNK_BYTES", 4 * classes * 8)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=generator, dtype=torch.bfloat16)
    w = torch.randn(classes, hidden, generator=generator, dtype=torch.bfloat16)
    target = torch.randint(0, classes, (rows,), generator=generator)
    loss, grad_x, grad_w = linear.reference(x, w, target)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    expected = F.cross_entropy(F.linear(x64, w64), target)
    expected.backward()
    assert grad_x.dtype == grad_w.dtype == torch.float64
    assert loss == pytest.approx(expected.item(), rel=1e-13)
    torch.testing.assert_close(grad_x, x64.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_w, w64.grad, rtol=1e-12, atol=1e-15)


def test_relative_error_is_the_largest_difference_over_the_largest_value(monkeypatch):
    monkeypatch.setattr(linear, "ERROR_CHUNK_ROWS", 2)
    expected = torch.tensor([[1.0, -4.0], [2.0, 0.5], [0.0, 1.0]], dtype=torch.float64)
    value = expected.float().clone()
    assert linear.relative_error(value, expected) == 0.0
    value[2, 1] += 0.5  # in the last chunk
    assert linear.relative_error(value, expected) == pytest.approx(0.5 / 4.0)


def _wall_ms(fn):
    """The CPU's stand-in for the GPU timer: the median wall time of three calls."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cpu_runner(monkeypatch):
    monkeypatch.setattr(run, "DEVICE", "cpu")
    runner = run.Runner(argparse.Namespace(warmup=1.0, rep=1.0, timer="do_bench", eager_rep=1.0, headline=False))
    runner.progress = Progress(100)
    return runner


def _peer(name, loss):
    return Impl(name, "peer", (linear.OP,), lambda op, inputs: (lambda x, w: loss(x, w, inputs["target"])))


def _raise(x, w, target):
    raise RuntimeError("boom")


def test_a_cpu_run_of_tiny_cases(monkeypatch):
    """The torch backend, a peer that raises, one that doubles the loss, and torch's ops: every case gets the
    products first, then a record per implementation with its time and errors (no memory on the CPU); the failing
    peer's record says why and the ones after it still run; the errors tell the doubled loss from the right one."""
    runner = _cpu_runner(monkeypatch)
    chosen, notes = linear.choose_impls(["torch"], peers=True)
    assert [impl.name for impl in chosen[:2]] == ["torch", "torch-native"]
    assert set(notes) == {"torch linear_cross_entropy", "liger fused linear cross-entropy", "cut cross-entropy"}
    chosen[1:1] = [_peer("raises", _raise), _peer("doubled", lambda x, w, t: 2 * F.cross_entropy(F.linear(x, w), t))]
    try:
        found = linear.run_cases(runner, chosen, [TINY], ["fp32", "bf16"], _wall_ms)
    finally:
        runner.progress.close()
    names = ["products"] + [impl.name for impl in chosen]
    assert [(r.impl, r.dtype, r.shape) for r in found] == \
        [(name, dtype, "48x32x300") for dtype in ("fp32", "bf16") for name in names]
    for dtype, tolerance in (("fp32", 1e-5), ("bf16", 1e-2)):
        case = {r.impl: r for r in found if r.dtype == dtype}
        products, backend = case["products"], case["torch"]
        assert products.role == "floor" and products.ms > 0 and products.of_products == 1.0
        assert products.loss_error is None and products.note == ""
        assert backend.ms > 0 and backend.of_products == pytest.approx(backend.ms / products.ms)
        assert backend.note == "" and backend.extra_gib is None and backend.of_logits is None
        for name in ("torch", "torch-native"):
            errors = (case[name].loss_error, case[name].grad_input_error, case[name].grad_weight_error)
            assert all(0 <= error < tolerance for error in errors), (name, dtype, errors)
        assert case["raises"].note == "error: RuntimeError: boom" and case["raises"].ms is None
        doubled = case["doubled"]
        assert doubled.note == "" and doubled.loss_error == pytest.approx(1.0, abs=0.02)
        assert doubled.grad_input_error == pytest.approx(1.0, abs=0.02)
        size = plan.ELEMENT_SIZE[dtype]
        assert backend.logits_gib == 48 * 300 * size / 2**30
        assert backend.gradients_gib == (48 + 300) * 32 * size / 2**30


def _record(impl, role, ms, extra=None, errors=(None, None, None), note="", shape="8192x4096x32000", dtype="bf16"):
    return records.LinearRecord(impl, role, dtype, shape, ms, None if ms is None else ms / 10.0, extra, 1.0, 4.0,
                                *errors, note)


def _fake_linear():
    errors = (1e-6, 2e-3, 3e-3)
    return [_record("products", "floor", 10.0, 1.0),
            _record("triton", "backend", 10.5, 1.25, errors),                 # met: 1.05x, 0.25 GiB = 1/16
            _record("cupy", "backend", 11.6, 2.0, errors),                    # slow, 1 GiB beyond: 1/4 of the logits
            _record("numba", "backend", None, note="error: RuntimeError: boom"),
            _record("torch-native", "peer", 30.0, 13.0, errors),
            _record("liger", "peer", 12.0, 1.5, errors),
            _record("cce", "peer", 11.0, 1.3, errors),
            _record("products", "floor", 20.0, shape="16384x4096x151936", dtype="fp32"),
            _record("triton", "backend", 21.0, shape="16384x4096x151936", dtype="fp32")]


def test_target_misses():
    found = _fake_linear()
    case = found[:7]
    assert linear_report.target_misses(case[1], case) == []
    assert linear_report.target_misses(case[2], case) == [
        "time: 1.16x products > 1.10x", "memory: 0.250 of the logits > 1/8", "memory: more than liger's 0.50 GiB",
        "memory: more than cce's 0.30 GiB", "not faster than cce"]
    assert linear_report.target_misses(case[3], case) == ["not timed"]
    # triton's 0.25 GiB beyond the gradients: more than a cce's 0.10
    assert linear_report.target_misses(case[1], case[:6] + [_record("cce", "peer", 11.0, 1.1)]) == [
        "memory: more than cce's 0.10 GiB"]
    # 1.104x shows as 1.10: met
    assert linear_report.target_misses(_record("triton", "backend", 11.04, 1.0), case[:1]) == []


def test_the_section_and_its_csv(tmp_path):
    results = records.Results({"gpu": "Fake GPU"}, 4000.0, [records.Timing(
        "copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)])
    results.linear = _fake_linear()
    text = report.markdown_report(results)
    section = text[text.index("## Fused linear cross-entropy"):]
    assert "### 8192x4096x32000 bf16" in section and "### 16384x4096x151936 fp32" in section
    assert "Logits 4.00 GiB, the two gradients 1.00 GiB." in section
    assert "| products | 10.00 | 1.00 | 1.00 | 0.00 | 0.000 | — | — | — |  |" in section
    assert "| triton | 10.50 | 1.05 | 1.25 | 0.25 | 0.062 | 1.0e-06 | 2.0e-03 | 3.0e-03 | met |" in section
    assert "| cupy | 11.60 | 1.16 | 2.00 | 1.00 | 0.250 | 1.0e-06 | 2.0e-03 | 3.0e-03 | missed: time: 1.16x " \
           "products > 1.10x; memory: 0.250 of the logits > 1/8;" in section
    assert "| numba | — | — | — | — | — | — | — | — | error: RuntimeError: boom; missed: not timed |" in section
    assert "| liger | 12.00 | 1.20 | 1.50 | 0.50 | 0.125 |" in section
    assert "| triton | 21.00 | 2.10 | — | — | — | — | — | — | missed: time: 2.10x products > 1.10x " \
           "(memory not measured) |" in section
    assert "≤ 1/8 of the logits and ≤ that of liger and cce, faster than every peer" in section
    out = tmp_path / "out"
    paths = report.write_reports(results, out)
    assert out / records.LINEAR_FILE in paths
    with open(out / records.LINEAR_FILE, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["impl"] for row in rows] == [r.impl for r in results.linear]
    assert float(rows[2]["beyond_gradients_gib"]) == 1.0 and float(rows[2]["of_logits"]) == 0.25
    assert rows[3]["ms"] == "" and rows[3]["note"] == "error: RuntimeError: boom"
    again = records.read_results(out)
    assert again.linear == results.linear
    assert report.markdown_report(again) == text
    # a run without the op: no section, no file
    results.linear = []
    assert "Fused linear" not in report.markdown_report(results)
    assert records.LINEAR_FILE not in [p.name for p in report.write_reports(results, tmp_path / "other")]


def test_the_command_runs_the_op_alone(monkeypatch, tmp_path, capsys):
    """``--ops lce --quick`` on the CPU, the GPU's parts stood in for (the copy, the environment, the timer) and
    the quick shape made tiny: it writes linear_cross_entropy.csv and the section, and times nothing else (no
    host time a call)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "copy_ms", lambda timer: 1.0)
    monkeypatch.setattr(run, "environment", lambda backends, runner, liger_note: {"gpu": "a CPU"})
    monkeypatch.setattr(run.timing, "long_call_ms", _wall_ms)
    monkeypatch.setattr(linear, "QUICK_SHAPES", [TINY])
    out = tmp_path / "out"
    assert command.main(["--ops", "lce", "--quick", "--backends", "torch", "--dtypes", "bf16", "--no-plots",
                         "--out", str(out)]) == 0
    assert f"wrote {out / records.LINEAR_FILE}" in capsys.readouterr().out
    saved = records.read_results(out)
    assert [(r.impl, r.dtype, r.shape) for r in saved.linear][:3] == [
        ("products", "bf16", "48x32x300"), ("torch", "bf16", "48x32x300"), ("torch-native", "bf16", "48x32x300")]
    assert all(r.ms is not None and r.note == "" for r in saved.linear)
    assert [t.role for t in saved.timings] == ["copy"] and saved.host_times == []
    assert saved.environment["linear_cross_entropy timing"] == linear.TIMING
    assert "cut cross-entropy" in saved.environment
    assert "### 48x32x300 bf16" in (out / "results.md").read_text()
