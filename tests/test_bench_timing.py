"""queued_bench, the benchmark's default timer, on a simulated host and CUDA stream (no GPU needed)."""

import pytest

from multisoft.bench import timing


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
