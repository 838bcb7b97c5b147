"""How the benchmark times: the timers on a simulated host and CUDA stream (queued_bench, the kernel time, which
leaves the host out, and the eager time's, which takes it in), then whole runs on the CPU with the test's timers
(which timer fills which column) and the host time a call (no GPU needed)."""

import csv
import sys
from pathlib import Path

import pytest

from multisoft import bench
from multisoft.bench import host_time, impls, plan, run, timing

ROOT = Path(__file__).resolve().parents[1]


class _Timeline:
    """A host and one CUDA stream in simulated milliseconds, for queued_bench without a GPU: each launch costs the
    host LAUNCH and reaches the stream LATENCY later; the stream runs what it gets in order; events stamp the stream's
    time; synchronize waits for the stream; torch.cuda._sleep runs `cycles / cycles_per_ms`."""

    LAUNCH, LATENCY = 0.004, 0.01

    def __init__(self, cycles_per_ms):
        self.host = self.gpu = 0.0
        self.cycles_per_ms = cycles_per_ms

    def launch(self, ms):
        self.host += self.LAUNCH
        self.gpu = max(self.gpu, self.host + self.LATENCY) + ms

    def synchronize(self):
        self.host = max(self.host, self.gpu)

    def event(self, enable_timing=True):
        line = self

        class Event:
            def record(self):
                line.launch(0.0)
                self.at = line.gpu

            def elapsed_time(self, other):
                return other.at - self.at

        return Event()

    def patch(self, monkeypatch):
        import types

        import torch

        class Flush:
            def zero_(_):
                self.launch(0.02)

        monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: Flush())
        monkeypatch.setattr(torch.cuda, "Event", self.event)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: self.launch(cycles / self.cycles_per_ms))
        monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: self.host / 1e3))
        monkeypatch.setattr(timing, "_sleep_cycles_per_ms", [])


@pytest.mark.parametrize("filtered", [True, False])
def test_queued_bench_leaves_out_calls_that_timed_the_host(monkeypatch, filtered):
    """A call costing the host 0.5 ms and the GPU 0.24, with the sleep calibrated at an eighth of the clock it then
    runs at (as on a GPU calibrated while it idled: every hold an eighth as long as meant): most calls of a batch
    begin on the GPU before the host has queued them and time the host. queued_bench leaves those out, holds longer
    and gives the GPU's time; without that (filtered=False: no doubling allowed) the median is the host's, which
    shows that the test tells the two apart."""
    line = _Timeline(cycles_per_ms=1000.0)
    line.patch(monkeypatch)
    timing._hold_gpu(1.0)          # calibrates the sleep
    line.synchronize()
    line.cycles_per_ms *= 8       # the GPU clocks up: every hold runs an eighth as long

    def call():
        line.host += 0.5 - line.LAUNCH
        line.launch(0.24)

    if not filtered:
        monkeypatch.setattr(timing, "HOLD_MARGIN_MAX", 0.0)
    ms = timing.queued_bench(call, warmup=5.0, rep=25.0)
    if filtered:
        assert ms == pytest.approx(0.24 + line.LAUNCH, abs=0.01)
    else:
        assert ms > 0.4


def test_queued_bench_ends_for_a_call_that_synchronises(monkeypatch):
    """Every call of one that synchronises inside times the host, and the host waits out every hold: the times are
    kept as they are from the first batch on, and no hold grows (with holds that doubled for such calls, torch's
    cross-entropy at 8192 x 128256 took a minute a cell on an H200)."""
    line = _Timeline(cycles_per_ms=1000.0)
    line.patch(monkeypatch)
    holds = []
    hold = timing._hold_gpu
    monkeypatch.setattr(timing, "_hold_gpu", lambda ms: (holds.append(ms), hold(ms)))

    def call():
        line.launch(0.1)
        line.synchronize()
        line.host += 0.3

    assert timing.queued_bench(call, warmup=5.0, rep=25.0) > 0.3
    batches = holds[2:]   # after the calibration's and the first estimate's
    assert batches and max(batches) <= batches[0] * (1 + 1e-9)


def _host_bound_call(line):
    """A call that costs the host 0.5 ms and the GPU 0.24 ms: the host, not the GPU, sets its pace."""
    def call():
        line.host += 0.5 - line.LAUNCH
        line.launch(0.24)
    return call


def test_the_eager_time_includes_the_host_and_the_kernel_time_does_not(monkeypatch):
    """The same host-bound call: the kernel time (queued_bench) is the GPU's 0.24 ms; the eager time (event_bench,
    what make_eager_timer falls back to without triton) is paced by the host's 0.5 ms."""
    line = _Timeline(cycles_per_ms=1000.0)
    line.patch(monkeypatch)
    kernel_ms = timing.queued_bench(_host_bound_call(line), warmup=5.0, rep=25.0)
    eager_ms = timing.event_bench(_host_bound_call(line), timing.EAGER_WARMUP_MS, timing.EAGER_REP_MS)
    assert kernel_ms == pytest.approx(0.24 + line.LAUNCH, abs=0.01)
    assert eager_ms == pytest.approx(0.5, abs=0.02)


def test_make_eager_timer_is_do_bench_with_the_eager_settings(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("triton.testing")
    fake.do_bench = lambda fn, **kwargs: (calls.append(kwargs), fn(), 0.125)[2]
    monkeypatch.setitem(sys.modules, "triton.testing", fake)
    timer, method = timing.make_eager_timer("queued", 7.0)
    assert timer(lambda: None) == 0.125
    assert calls == [{"warmup": timing.EAGER_WARMUP_MS, "rep": 7.0, "return_mode": "median"}]
    assert method.startswith("triton.testing.do_bench") and "rep 7 ms" in method
    assert timing.make_eager_timer("queued")[1].endswith(f"rep {timing.EAGER_REP_MS:g} ms)")
    # without triton: event_bench, which times the host too
    monkeypatch.setitem(sys.modules, "triton.testing", None)
    timer, method = timing.make_eager_timer("queued", 7.0)
    assert method.startswith("torch.cuda.Event")
    # a kernel timer that is do_bench already: the kernel time is the eager time, not taken twice
    timer, method = timing.make_eager_timer("do_bench")
    assert timer is None and "--timer do_bench" in method


def test_host_call_is_a_training_steps_call():
    """forward: f(x) of the input itself; forward+backward: f of one leaf that requires grad, then backward of the
    output with the preallocated gradient (of a loss: of the loss alone), the leaf's grad cleared before each call
    (a gradient that accumulated would double)."""
    import torch

    seen = []

    def make(op, inputs):
        def f(x):
            seen.append(x)
            return x * 3.0 if op == "softmax" else (x * 2.0).sum()
        return f
    impl = impls.Impl("fake", "backend", ("softmax", "cross_entropy"), make)
    inputs = impls.make_inputs(host_time.host_case("softmax"), "fp32", "cpu")
    host_time.host_call(impl, "softmax", "forward", inputs)()
    assert seen[-1] is inputs["x"] and not seen[-1].requires_grad
    call = host_time.host_call(impl, "softmax", "forward+backward", inputs)
    call()
    call()
    leaf = seen[-1]
    assert seen[-2] is leaf and leaf.requires_grad and leaf.is_leaf
    assert torch.equal(leaf.grad, inputs["grad"] * 3.0)
    loss_inputs = impls.make_inputs(host_time.host_case("cross_entropy"), "fp32", "cpu")
    assert loss_inputs["x"].shape == host_time.HOST_SHAPE and loss_inputs["grad"] is None
    call = host_time.host_call(impl, "cross_entropy", "forward+backward", loss_inputs)
    call()
    call()
    assert torch.equal(seen[-1].grad, torch.full(host_time.HOST_SHAPE, 2.0))


def _recording(impl):
    """``impl`` whose calls append their argument (the x, or leaf, each call is given) to the list returned."""
    import dataclasses

    seen = []

    def make(op, inputs):
        f = impl.make(op, inputs)
        return lambda x: (seen.append(x), f(x))[1]
    return dataclasses.replace(impl, make=make), seen


def test_cross_entropy_is_timed_as_a_training_step_builds_it():
    """Cross-entropy on the torch backend: forward reads logits that do not require grad; there is no backward of
    its own; forward+backward builds a new graph every call (multisoft's graph takes one backward), and the leaf's
    grad is float64 torch's gradient after every call. The in-place entry runs on its own copy of the logits (the
    inputs stay intact), which holds the gradient after a call; later calls run on those values: finite, within
    1/M."""
    import torch
    import torch.nn.functional as F

    rows, classes = 8, 100
    inputs = impls.make_inputs(plan.Case("cross_entropy", "test", "8x100", (rows, classes), rows * classes,
                                         n=classes), "fp32", "cpu")
    x, target = inputs["x"], inputs["target"]
    before = x.clone()
    logits64 = x.double().requires_grad_(True)
    F.cross_entropy(logits64, target).backward()
    expected = logits64.grad.float()

    impl, seen = _recording(impls.backend_impl("torch"))
    loss = impls.prepare(impl, "cross_entropy", "forward", inputs)()
    assert seen[-1] is x and loss.grad_fn is None
    with pytest.raises(ValueError, match="cross_entropy has no backward"):
        impls.prepare(impl, "cross_entropy", "backward", inputs)
    step = impls.prepare(impl, "cross_entropy", "forward+backward", inputs)
    for _ in range(3):
        step()
        torch.testing.assert_close(seen[-1].grad, expected)
    assert seen[-1] is seen[-2] and seen[-1].is_leaf and torch.equal(x, before)
    host = host_time.host_call(impl, "cross_entropy", "forward+backward", inputs)
    host()
    host()
    torch.testing.assert_close(seen[-1].grad, expected)

    inplace, seen = _recording(impls.inplace_impl("torch"))
    step = impls.prepare(inplace, "cross_entropy", "forward+backward", inputs)
    step()
    logits = seen[-1]  # an activation, as a model's logits are (inplace_backward refuses a leaf)
    assert not logits.is_leaf and torch.equal(x, before)
    leaf = logits.grad_fn.next_functions[0][0].variable
    assert leaf.grad.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(logits.detach(), expected)
    for _ in range(2):
        step()
        assert seen[-1] is logits and leaf.grad.data_ptr() == logits.data_ptr()
        values = logits.detach()
        assert bool(torch.isfinite(values).all()) and float(values.abs().max()) <= 1 / rows
    assert torch.equal(x, before)


def test_an_implementation_that_writes_into_its_input_gets_a_copy():
    """A peer whose forward writes into x (as some Liger versions do, grad or not): the inputs shared by every
    implementation of a case stay intact, in the timings and in the host time."""
    import torch

    def make(op, inputs):
        return lambda x: (x.detach().mul_(0.0), (x * 2.0).sum())[1]
    impl = impls.Impl("writer", "peer", ("cross_entropy",), make, inplace_ops=("cross_entropy",))
    inputs = impls.make_inputs(host_time.host_case("cross_entropy"), "fp32", "cpu")
    before = inputs["x"].clone()
    for direction in plan.OP_DIRECTIONS["cross_entropy"]:
        impls.prepare(impl, "cross_entropy", direction, inputs)()
        host_time.host_call(impl, "cross_entropy", direction, inputs)()
    assert torch.equal(inputs["x"], before)


def _failing_backend(monkeypatch):
    """A backend whose softmax raises when called and which has no cross-entropy module at all."""
    import types

    package = types.ModuleType("multisoft_failing")
    package.NAME, package.PRIORITY = "failing", 1
    package.version = lambda: "0"
    package.unavailable_reason = lambda device, dtype: None
    softmax = types.ModuleType("multisoft_failing.softmax")

    def forward(x, out, log):
        raise RuntimeError("kernel exploded")
    softmax.forward = softmax.backward = forward
    monkeypatch.setitem(sys.modules, "multisoft_failing", package)
    monkeypatch.setitem(sys.modules, "multisoft_failing.softmax", softmax)


# The dry runs' timers: every call made once (a failing one raises), the kernel timer giving KERNEL_MS, the eager
# one EAGER_MS, so that each column shows which timer it came from.
KERNEL_MS, EAGER_MS = 1.0, 4.0


def _dry_run_setup(monkeypatch) -> list:
    """The run on the CPU: tiny shapes, the test's timers and a CUDA that does nothing; the timers asked for, as
    (warmup, rep, kind), are appended to the list returned."""
    import types

    import torch

    from multisoft import _registry

    for name, value in {"COPY_BYTES": 1 << 20, "QUICK_HEADLINE": [(8, 64)],
                        "QUICK_SWEEP_COLS": [32, 64, 128], "SWEEP_ELEMENTS": 512,
                        "QUICK_CROSS_ENTROPY": [(8, 100)], "QUICK_LAYOUTS": [(16, 0.5, False), (16, 0.5, True)],
                        "HEADS": 2, "SEQ": 64,
                        "HEADLINE_CELLS": [("softmax", "fp32", (8, 64)), ("softmax", "bf16", (4, 32)),
                                           ("cross_entropy", "bf16", (8, 100)),
                                           ("cross_entropy", "fp32", (8, 100))]}.items():
        monkeypatch.setattr(plan, name, value)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(host_time, "HOST_CALLS", 20)
    timers = []

    def make_timer(warmup, rep, kind):
        timers.append((warmup, rep, kind))
        ms = {"queued": KERNEL_MS, "do_bench": EAGER_MS}[kind]
        return (lambda fn: (fn(), ms)[1]), f"{kind} (test)"
    monkeypatch.setattr(timing, "make_timer", make_timer)
    monkeypatch.setattr(impls, "liger_peer", lambda: (None, "hidden by the test"))  # its kernels need a GPU
    properties = types.SimpleNamespace(name="CPU", major=0, minor=0, total_memory=1 << 30)
    for name, value in {"is_available": lambda: True, "synchronize": lambda: None, "empty_cache": lambda: None,
                        "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 0,
                        "max_memory_allocated": lambda: 0, "current_device": lambda: 0,
                        "get_device_properties": lambda index: properties}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.syspath_prepend(str(ROOT / "backends"))
    monkeypatch.setattr(_registry, "_default_order", None)
    _failing_backend(monkeypatch)
    monkeypatch.setitem(_registry._backends, "failing", _registry.Backend("failing", "multisoft_failing"))
    monkeypatch.setitem(_registry._backends, "broken", _registry.Backend("broken", "multisoft_no_such_package"))
    return timers


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _check_timers(rows, timers):
    """Each timed cell has the kernel timer's time and the eager timer's, each as a fraction of the copy (which the
    kernel timer timed)."""
    assert timers == [(5.0, 25.0, "queued"), (timing.EAGER_WARMUP_MS, timing.EAGER_REP_MS, "do_bench")]
    copy_gb_per_s = 2 * plan.COPY_BYTES / (KERNEL_MS * 1e6)
    timed = [r for r in rows if r["role"] != "copy" and r["ms"]]
    assert timed
    for r in timed:
        assert (float(r["ms"]), float(r["eager_ms"])) == (KERNEL_MS, EAGER_MS)
        assert float(r["fraction_of_copy"]) == pytest.approx(int(r["bytes"]) / (KERNEL_MS * 1e6) / copy_gb_per_s,
                                                             rel=1e-5)
        assert float(r["eager_fraction"]) == pytest.approx(int(r["bytes"]) / (EAGER_MS * 1e6) / copy_gb_per_s,
                                                           rel=1e-5)
    assert all(r["eager_ms"] == "" and r["eager_fraction"] == "" for r in rows if r["role"] != "copy" and not r["ms"])


def test_dry_run_on_cpu(tmp_path, monkeypatch):
    """The whole run on the CPU with tiny shapes and the test's timers: the pipeline, not the numbers."""
    timers = _dry_run_setup(monkeypatch)
    out = tmp_path / "res"
    assert bench.main(["--quick", "--backends", "torch,failing,broken", "--out", str(out)]) == 0

    rows = _rows(out / "timings.csv")
    _check_timers(rows, timers)
    ops = {r["op"] for r in rows}
    assert ops == {"copy", "softmax", "log_softmax", "cross_entropy", "blocksparse_softmax"}
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert torch_rows and all(float(r["ms"]) > 0 and float(r["fraction_of_copy"]) > 0 for r in torch_rows)
    # 3 shapes per dense op (headline, 2 sweep), 2 dtypes, 3 directions
    assert len([r for r in torch_rows if r["op"] == "softmax"]) == 3 * 2 * 3
    # cross-entropy: forward and forward+backward (no backward of its own), 1 x and 2 x M·V x element size
    for impl in ("torch", "torch-native"):
        cells = [(r["dtype"], r["shape"], r["direction"], int(r["bytes"])) for r in rows
                 if r["impl"] == impl and r["op"] == "cross_entropy"]
        assert cells == [(dtype, shape, direction, factor * 8 * 100 * size)
                         for dtype, size in (("fp32", 4), ("bf16", 2))
                         for shape in ("8x100", "8x100 softcap=30 z=1e-4")
                         for direction, factor in (("forward", 1), ("forward+backward", 2))]
    # the long copy, then a copy of each dense headline shape's bytes (softmax's and cross-entropy's), 2 dtypes
    copies = [(r["shape"], r["dtype"], int(r["bytes"])) for r in rows
              if r["op"] == "copy" and r["group"] == "headline"]
    assert copies == [("8x64", "fp32", 2 * 8 * 64 * 4), ("8x64", "bf16", 2 * 8 * 64 * 2),
                      ("8x100", "fp32", 2 * 8 * 100 * 4), ("8x100", "bf16", 2 * 8 * 100 * 2)]
    assert {r["impl"] for r in rows if r["role"] == "peer"} == {"torch-native"}
    failing = [r for r in rows if r["impl"] == "failing"]
    assert all(r["ms"] == "" for r in failing)
    assert any("kernel exploded" in r["note"] for r in failing if r["op"] == "softmax")
    assert all(r["note"].startswith("error: ModuleNotFoundError") for r in failing if r["op"] == "cross_entropy")
    assert all(r["impl"] != "broken" or r["note"].startswith("error:") for r in rows)
    inplace = [r for r in rows if r["impl"] == "torch inplace"]
    assert [r["direction"] for r in inplace] == ["forward+backward"] * 4 and all(r["ms"] for r in inplace)
    for row in inplace:  # timed in its case, beside the ordinary call: only that case's rows between the two
        at = rows.index(row)
        plain = rows.index(next(r for r in rows if (r["impl"], r["op"], r["shape"], r["dtype"], r["direction"]) == (
            "torch", "cross_entropy", row["shape"], row["dtype"], "forward+backward")))
        assert plain < at and all((r["op"], r["shape"], r["dtype"]) == ("cross_entropy", row["shape"], row["dtype"])
                                  for r in rows[plain:at])

    with open(out / "memory.csv", newline="") as handle:
        memory = {(r["impl"], r["dtype"]): r for r in csv.DictReader(handle)}
    assert memory[("torch", "fp32")]["peak_mib"] == "0"
    assert memory[("torch inplace", "bf16")]["peak_mib"] == "0"
    assert memory[("failing", "fp32")]["note"].startswith("error:")
    with open(out / "first_calls.csv", newline="") as handle:
        first = {(r["impl"], r["op"], r["direction"]) for r in csv.DictReader(handle)}
    assert ("torch", "softmax", "forward") in first and ("torch", "blocksparse_softmax", "backward") in first
    _check_host_times(_rows(out / "host_time.csv"))
    text = (out / "results.md").read_text()
    for op in ("softmax", "log_softmax", "cross_entropy", "blocksparse_softmax"):
        assert f"## {op}" in text
    assert "kernel exploded" in text
    assert "## copy of each headline shape's bytes" in text and "| 8x100 | bf16 |" in text
    assert "- commit: " in text
    assert "- eager timing: do_bench (test)" in text and "## host time a call" in text
    assert f"Bytes counted: {plan.bytes_counted()}." in text


def _check_host_times(rows):
    """host_time.csv of the dry runs: each implementation's forward and forward+backward of softmax and
    cross-entropy (the in-place cross-entropy: forward+backward only) on an 8x128 fp32 input, the kernel called
    alone beside a backend's softmax forward; the failures noted."""
    host = {(r["impl"], r["op"], r["direction"]): r for r in rows}
    both = [(op, direction) for op in ("softmax", "cross_entropy") for direction in ("forward", "forward+backward")]
    assert sorted(host) == sorted([(impl, op, direction) for impl in ("torch", "failing", "broken", "torch-native")
                                   for op, direction in both]
                                  + [(f"{impl} inplace", "cross_entropy", "forward+backward")
                                     for impl in ("torch", "failing", "broken")])
    assert all((r["shape"], r["dtype"]) == ("8x128", "fp32") for r in rows)
    for impl in ("torch", "torch-native", "torch inplace"):
        assert all(float(r["us"]) > 0 and r["note"] == "" for key, r in host.items() if key[0] == impl)
    assert float(host["torch", "softmax", "forward"]["kernel_us"]) > 0
    assert host["torch-native", "softmax", "forward"]["kernel_us"] == ""
    assert host["torch", "softmax", "forward+backward"]["kernel_us"] == ""
    assert "kernel exploded" in host["failing", "softmax", "forward"]["note"]
    assert host["failing", "softmax", "forward"]["us"] == ""
    assert host["failing", "cross_entropy", "forward"]["note"].startswith("error: ModuleNotFoundError")
    assert all(r["note"].startswith("error:") for key, r in host.items() if key[0].startswith("broken"))


def test_headline_dry_run_on_cpu(tmp_path, monkeypatch):
    """--headline times the headline cells only (each in its own dtypes), forward and forward+backward, on every
    backend and peer; then the host time a call; no peak memory; results.md leads with the headline summary."""
    timers = _dry_run_setup(monkeypatch)
    out = tmp_path / "res"
    assert bench.main(["--headline", "--no-plots", "--backends", "torch,failing,broken", "--out", str(out)]) == 0

    rows = _rows(out / "timings.csv")
    _check_timers(rows, timers)
    cells = [(op, dtype, f"{m}x{n}") for op, dtype, (m, n) in plan.HEADLINE_CELLS]
    impls_of = {"softmax": ["torch", "failing", "broken", "torch-native"],
                "cross_entropy": ["torch", "failing", "broken", "torch inplace", "failing inplace",
                                  "broken inplace", "torch-native"]}
    expected = [(op, dtype, shape, impl, direction) for op, dtype, shape in cells for impl in impls_of[op]
                for direction in ("forward", "forward+backward")
                if not (impl.endswith("inplace") and direction == "forward")]
    timed = [(r["op"], r["dtype"], r["shape"], r["impl"], r["direction"]) for r in rows if r["role"] != "copy"]
    assert sorted(timed) == sorted(expected)
    copies = [(r["shape"], r["dtype"]) for r in rows if r["op"] == "copy" and r["group"] == "headline"]
    assert copies == [("8x64", "fp32"), ("4x32", "bf16"), ("8x100", "fp32"), ("8x100", "bf16")]
    assert not (out / "memory.csv").exists()
    _check_host_times(_rows(out / "host_time.csv"))
    assert "## headline: what a user gets on CPU" in (out / "results.md").read_text()
    # the expected row is built from the CSV files (six significant digits), so is the report made from them
    assert bench.main(["--report-only", "--no-plots", "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    fraction = {(r["op"], r["dtype"], r["shape"]): "{:.2f} / {:.2f}".format(
        float(r["fraction_of_copy"]), float(r["eager_fraction"]))
        for r in rows if r["impl"] == "torch" and r["direction"] == "forward+backward"}
    host = {r["op"]: f"{float(r['us']):.0f}" for r in _rows(out / "host_time.csv")
            if r["impl"] == "torch" and r["direction"] == "forward+backward"}
    assert ("| torch | " + " | ".join(fraction[cell] for cell in cells)
            + f" | {host['softmax']} | {host['cross_entropy']} |") in text
