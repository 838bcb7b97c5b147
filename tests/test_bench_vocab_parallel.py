"""The benchmark's vocabulary-parallel cross-entropy (``--ops vocab_parallel``): its plan, the reason it gives
without 2 GPUs, its measuring worker run on the CPU (2 spawned processes, gloo, the torch backend, a wall-clock
timer), its accuracy gate, and its CSV and section of results.md."""

import argparse
import csv

import pytest
import torch
import torch.nn.functional as F

from multisoft.bench import command, plan, records, report, run, vocab_parallel, vocab_parallel_report
from multisoft.bench.progress import Progress

TINY = (24, 301)  # (M, V): an odd V, so the ranks' widths differ (151 and 150)


def test_the_op_is_asked_for_by_name_only():
    assert command.parse_args(["--ops", "vp"]).ops == ["vocab_parallel"]
    assert command.parse_args(["--ops", "ce,vocab_parallel"]).ops == ["cross_entropy", "vocab_parallel"]
    assert "vocab_parallel" not in command.parse_args([]).ops
    assert plan.plan_cases(["vocab_parallel"], quick=False) == {}


def test_the_cases():
    assert vocab_parallel.cases(quick=False) == [(16384, 151936)]
    assert vocab_parallel.cases(quick=True) == [(4096, 32000)]
    assert vocab_parallel.shape_label((16384, 151936)) == "16384x151936"
    assert vocab_parallel.widths(151936, 2) == [75968, 75968]
    assert vocab_parallel.widths(301, 2) == [151, 150]


def _runner():
    runner = argparse.Namespace(progress=Progress(100))
    runner.skip_reason = lambda impl, op, dtype_name: "unavailable: no such GPU" if impl.name == "cupy" else ""
    return runner


def test_without_two_gpus_every_record_says_so_and_nothing_runs(monkeypatch):
    def spawned(*args, **kwargs):
        raise AssertionError("nothing may be spawned without 2 CUDA devices")

    monkeypatch.setattr(vocab_parallel, "measure", spawned)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    runner = _runner()
    try:
        found = vocab_parallel.run_cases(runner, ["triton", "cupy"], [(4096, 32000)], ["bf16", "fp32"])
    finally:
        runner.progress.close()
    assert [(r.impl, r.dtype, r.shape, r.ranks) for r in found] == [
        (name, dtype, "4096x32000", 2) for name in ("triton", "cupy") for dtype in ("bf16", "fp32")]
    assert all(r.note == "needs 2 CUDA devices" and r.split_ms is None and r.unsplit_ms is None for r in found)
    assert vocab_parallel.run_cases(runner, ["triton"], [], ["bf16"]) == []


def test_with_two_gpus_a_backend_that_cannot_run_is_not_spawned(monkeypatch):
    spawned = []

    def measure(backend, case_list):
        spawned.append((backend, case_list))
        return [records.VocabParallelRecord(backend, dtype, vocab_parallel.shape_label(shape), 2, 1.0, 0.5)
                for shape, dtype in case_list]

    monkeypatch.setattr(vocab_parallel, "measure", measure)
    monkeypatch.setattr(vocab_parallel, "devices_missing", lambda: "")
    runner = _runner()
    try:
        found = vocab_parallel.run_cases(runner, ["triton", "cupy"], [(4096, 32000)], ["bf16", "fp32"])
    finally:
        runner.progress.close()
    assert spawned == [("triton", [((4096, 32000), "bf16"), ((4096, 32000), "fp32")])]
    assert [(r.impl, r.dtype, r.split_ms, r.note) for r in found] == [
        ("triton", "bf16", 0.5, ""), ("triton", "fp32", 0.5, ""),
        ("cupy", "bf16", None, "unavailable: no such GPU"), ("cupy", "fp32", None, "unavailable: no such GPU")]


def test_the_worker_on_the_cpu_times_the_right_loss():
    """Two gloo processes, the torch backend: each case has the three times, the slower rank's split time, and the
    split and unsplit losses of float64 F.cross_entropy on the same logits (made again here)."""
    case_list = [(TINY, "fp32"), (TINY, "bf16")]
    found = vocab_parallel.measure("torch", case_list, world=2, device_type="cpu",
                                   timer=vocab_parallel.wall_clock_ms)
    assert [(r.impl, r.dtype, r.shape, r.ranks) for r in found] == [
        ("torch", "fp32", "24x301", 2), ("torch", "bf16", "24x301", 2)]
    for record in found:
        assert record.note == ""
        assert record.unsplit_ms > 0 and record.collective_ms > 0
        each = [float(ms) for ms in record.rank_ms.split()]
        assert len(each) == 2 and all(ms > 0 for ms in each)
        assert record.split_ms == pytest.approx(max(each), rel=1e-3)
        logits, target = vocab_parallel.make_inputs(TINY, record.dtype, torch.device("cpu"))
        expected = F.cross_entropy(logits.double(), target).item()
        assert record.loss == pytest.approx(expected, rel=1e-5)
        assert record.unsplit_loss == pytest.approx(expected, rel=1e-5)
        assert 0 <= record.loss_error < 1e-5
        assert 0 <= record.grad_error <= vocab_parallel.GRADIENT_TOLERANCE[record.dtype]


def test_the_reference_errors_find_a_wrong_loss_and_a_wrong_gradient():
    """Against float64 autograd of F.cross_entropy; a loss 1 % off and one gradient element off by a quarter of
    the largest are found, and the gate then keeps the call from being timed."""
    logits, target = vocab_parallel.make_inputs((6, 9), "fp32", torch.device("cpu"), seed=3)
    target[0] = 5  # in the columns [4, 9) compared below
    logits64 = logits.double().requires_grad_(True)
    loss64 = F.cross_entropy(logits64, target)
    loss64.backward()
    grad = logits64.grad[:, 4:].float().clone()
    assert vocab_parallel.reference_errors(logits, target, 4, loss64.item(), grad) == (
        pytest.approx(0.0, abs=1e-15), pytest.approx(0.0, abs=1e-7))
    largest = logits64.grad[:, 4:].abs().max().item()
    grad[2, 1] += 0.25 * largest
    loss_error, grad_error = vocab_parallel.reference_errors(logits, target, 4, 1.01 * loss64.item(), grad)
    assert loss_error == pytest.approx(0.01, rel=1e-9)
    assert grad_error == pytest.approx(0.25, rel=1e-5)
    assert vocab_parallel.accuracy_note("fp32", "the split call", loss_error, grad_error) == (
        "not timed: the split call wrong: loss error 1.0e-02 > 1e-04, gradient error 2.5e-01 > 1e-04")
    assert vocab_parallel.accuracy_note("bf16", "the split call", 5e-5, 5e-3) == ""
    assert vocab_parallel.accuracy_note("bf16", "the unsplit call", float("nan"), 0.0).startswith(
        "not timed: the unsplit call wrong: loss error nan")


def _record(impl, unsplit, split, collective, note="", dtype="bf16", shape="16384x151936"):
    each = "" if split is None else f"{split - 0.1:.4g} {split:.4g}"
    return records.VocabParallelRecord(impl, dtype, shape, 2, unsplit, split, each, collective,
                                       None if split is None else 12.25, None if split is None else 12.25,
                                       None if split is None else 2e-7, None if split is None else 3e-3, note)


def _fake_records():
    return [_record("triton", 4.0, 2.2, 0.05),    # 0.55x: met, as shown
            _record("cupy", 4.0, 2.4, 0.1),       # 0.60x: missed
            _record("numba", None, None, None, note="rank 1: error: RuntimeError: boom"),
            _record("torch", None, None, None, note="needs 2 CUDA devices", dtype="fp32")]


def test_the_section_and_the_csv_round_trip(tmp_path):
    results = records.Results({"gpu": "H200"}, 4000.0, vocab_parallel=_fake_records())
    cupy = results.vocab_parallel[1]
    assert cupy.of_unsplit == pytest.approx(0.6) and cupy.collective_share == pytest.approx(0.1 / 2.4)
    assert results.vocab_parallel[2].of_unsplit is None and results.vocab_parallel[2].collective_share is None
    text = report.markdown_report(results)
    section = text[text.index("## Vocabulary-parallel cross-entropy"):]
    assert "the split call's floor is about 1/2 = 0.50× the unsplit call's" in section
    assert "split ≤ 0.55× unsplit" in section
    assert "| triton | bf16 | 16384x151936 | 2 | 4.000 | 2.200 | 2.1 2.2 | 0.55 | 0.050 | 0.02 | 2.0e-07 | " \
           "3.0e-03 | met |" in section
    assert "| cupy | bf16 | 16384x151936 | 2 | 4.000 | 2.400 | 2.3 2.4 | 0.60 | 0.100 | 0.04 | 2.0e-07 | " \
           "3.0e-03 | missed: 0.60× > 0.55× |" in section
    assert "| numba | bf16 | 16384x151936 | 2 | — | — | — | — | — | — | — | — | rank 1: error: RuntimeError: " \
           "boom |" in section
    assert "| torch | fp32 | 16384x151936 | 2 | — | — | — | — | — | — | — | — | needs 2 CUDA devices |" in section
    out = tmp_path / "out"
    paths = report.write_reports(results, out)
    assert out / records.VOCAB_PARALLEL_FILE in paths
    with open(out / records.VOCAB_PARALLEL_FILE, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["impl"] for row in rows] == ["triton", "cupy", "numba", "torch"]
    assert float(rows[1]["of_unsplit"]) == pytest.approx(0.6) and rows[2]["split_ms"] == ""
    again = records.read_results(out)
    assert again.vocab_parallel == results.vocab_parallel
    assert report.markdown_report(again) == text
    results.vocab_parallel = []
    assert "Vocabulary-parallel" not in report.markdown_report(results)
    assert records.VOCAB_PARALLEL_FILE not in [p.name for p in report.write_reports(results, tmp_path / "other")]


def test_the_verdict_is_taken_as_shown():
    assert vocab_parallel_report.verdict(_record("triton", 4.0, 2.219, 0.05)) == "met"  # 0.5548 shows as 0.55
    assert vocab_parallel_report.verdict(_record("triton", 4.0, 2.221, 0.05)) == "missed: 0.56× > 0.55×"
    assert vocab_parallel_report.verdict(_record("triton", None, None, None)) == "not timed"


def test_the_command_on_a_machine_without_two_gpus(monkeypatch, tmp_path, capsys):
    """``--ops vp --quick`` with one (stood-in) GPU: every record says why, the CSV and the section are written,
    nothing else is timed, and --report-only writes the same section again from the CSV."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "copy_ms", lambda timer: 1.0)
    monkeypatch.setattr(run, "environment", lambda backends, runner, liger_note: {"gpu": "a CPU"})
    out = tmp_path / "out"
    assert command.main(["--ops", "vp", "--quick", "--backends", "torch", "--dtypes", "bf16,fp32", "--no-plots",
                         "--out", str(out)]) == 0
    assert f"wrote {out / records.VOCAB_PARALLEL_FILE}" in capsys.readouterr().out
    saved = records.read_results(out)
    assert [(r.impl, r.dtype, r.shape, r.note) for r in saved.vocab_parallel] == [
        ("torch", dtype, "4096x32000", "needs 2 CUDA devices") for dtype in ("bf16", "fp32")]
    assert [t.role for t in saved.timings] == ["copy"] and saved.host_times == [] and saved.linear == []
    assert saved.environment["vocab_parallel timing"] == vocab_parallel.TIMING
    assert saved.environment["vocab_parallel devices"].startswith("CUDA devices: 1, 2 used; NCCL ")
    written = (out / "results.md").read_text()
    assert "| torch | bf16 | 4096x32000 | 2 | — |" in written
    (out / "results.md").unlink()
    assert command.main(["--report-only", "--no-plots", "--out", str(out)]) == 0
    assert (out / "results.md").read_text() == written
