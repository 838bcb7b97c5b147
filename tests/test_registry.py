"""The registry's ops per backend: a backend that implements a subset of the ops (``OPS`` in its ``__init__.py``)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import multisoft
from harness import backend_params
from multisoft import _registry, cli
from multisoft.check import reference_cross_entropy, reference_softmax

CPU = torch.device("cpu")
FAKE = "softmaxonly"
EVERY_OP = ("softmax", "cross_entropy", "blocksparse", "log_probs")  # written out: not read from the code under test


@pytest.fixture
def softmax_only(monkeypatch):
    """A backend ``softmaxonly`` of the highest priority, able to run anywhere, that declares ``OPS = ("softmax",)``
    and has no other kernel module; its softmax runs torch's backend's kernels, and each call is appended to the
    list returned."""
    calls = []
    package = types.ModuleType(f"multisoft_{FAKE}")
    package.NAME, package.PRIORITY, package.OPS = FAKE, 10**6, ("softmax",)
    package.version = lambda: "0"
    package.unavailable_reason = lambda device, dtype: None
    softmax = types.ModuleType(f"multisoft_{FAKE}.softmax")
    torch_kernels = _registry.get_backend("torch").kernels("softmax")

    def forward(x, out, log):
        calls.append("forward")
        torch_kernels.forward(x, out, log)

    def backward(y, dy, dx, log):
        calls.append("backward")
        torch_kernels.backward(y, dy, dx, log)
    softmax.forward, softmax.backward = forward, backward
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, softmax.__name__, softmax)
    monkeypatch.setitem(_registry._backends, FAKE, _registry.Backend(FAKE, package.__name__))
    monkeypatch.setattr(_registry, "_default_order", None)
    monkeypatch.delenv(_registry.ENV_VAR, raising=False)
    _registry.clear_caches()
    return calls


def _ce_inputs():
    logits = torch.randn(4, 7, requires_grad=True)
    return logits, torch.tensor([0, 6, 3, 2])


def test_supports_reads_the_declared_ops(softmax_only):
    fake = _registry.get_backend(FAKE)
    assert fake.ops == ("softmax",)
    assert fake.supports("softmax") and not fake.supports("cross_entropy") and not fake.supports("blocksparse")
    assert _registry.get_backend("torch").ops == EVERY_OP, "a backend that declares no OPS implements every op"
    with pytest.raises(ValueError, match="op must be one of .*'matmul'"):
        fake.supports("matmul")


def test_a_malformed_ops_declaration_names_the_backend(softmax_only, monkeypatch):
    monkeypatch.setattr(sys.modules[f"multisoft_{FAKE}"], "OPS", "softmax")  # a string, not a tuple
    with pytest.raises(TypeError, match=f"backend '{FAKE}': OPS must be a tuple"):
        _registry.get_backend(FAKE).supports("softmax")


def test_supports_imports_no_framework():
    """Asking every installed backend about every op imports no kernel module and no framework."""
    code = ("import sys; from multisoft import _registry as r\n"
            "answers = [b.supports(op) for b in r._default_backends() for op in r.OPS]\n"
            "assert answers and all(answers), answers\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('triton', 'cupy', 'numba')\n"
            "          or (m.startswith('multisoft_') and '.' in m)]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_automatic_choice_skips_a_backend_lacking_the_op(softmax_only, monkeypatch):
    without_fake = _registry.resolve(CPU, torch.float32, op="cross_entropy").name
    assert without_fake != FAKE
    x = torch.randn(3, 5)
    torch.testing.assert_close(multisoft.softmax(x, -1), reference_softmax(x, -1, False).float())
    assert softmax_only == ["forward"], "the highest-priority backend runs the op it implements"
    assert _registry.resolve(CPU, torch.float32, op="softmax").name == FAKE
    assert _registry.resolve(CPU, torch.float32, op="cross_entropy").name == without_fake
    logits, target = _ce_inputs()
    loss = multisoft.cross_entropy(logits, target)
    torch.testing.assert_close(loss, reference_cross_entropy(logits.detach().double(), target).float())
    assert softmax_only == ["forward"], "cross_entropy never reached the backend that lacks it"


def test_a_backend_named_for_an_op_it_lacks_raises(softmax_only, monkeypatch):
    logits, target = _ce_inputs()
    message = f"backend '{FAKE}' does not implement cross_entropy .*implements softmax.*cross_entropy: .*torch"
    with pytest.raises(multisoft.BackendUnavailableError, match=message):
        multisoft.cross_entropy(logits, target, backend=FAKE)
    with pytest.raises(multisoft.BackendUnavailableError, match=message):
        with multisoft.use_backend(FAKE):
            multisoft.cross_entropy(logits, target)
    with pytest.raises(multisoft.BackendUnavailableError, match=message):
        multisoft.linear_cross_entropy(torch.randn(4, 3), torch.randn(7, 3), target, backend=FAKE)
    with pytest.raises(multisoft.BackendUnavailableError, match="does not implement blocksparse"):
        multisoft.blocksparse_softmax(torch.randn(1, 1, 16, 16), torch.ones(1, 1, 1, dtype=torch.int64), 16,
                                      backend=FAKE)
    monkeypatch.setenv(_registry.ENV_VAR, FAKE)
    with pytest.raises(multisoft.BackendUnavailableError, match=f"{_registry.ENV_VAR}='{FAKE}': " + message):
        multisoft.cross_entropy(logits, target)
    assert softmax_only == []
    multisoft.softmax(torch.randn(2, 3), -1)
    assert softmax_only == ["forward"], "named alone, it still runs the op it implements"


def test_a_priority_list_skips_a_backend_lacking_the_op(softmax_only, monkeypatch, cross_entropy_calls):
    monkeypatch.setenv(_registry.ENV_VAR, f"{FAKE},torch")
    logits, target = _ce_inputs()
    multisoft.cross_entropy(logits, target)
    assert _registry.resolve(CPU, torch.float32, op="cross_entropy").name == "torch"
    assert len(cross_entropy_calls) == 1 and softmax_only == []
    multisoft.softmax(torch.randn(2, 3), -1)
    assert softmax_only == ["forward"], "the list's first backend runs the op it implements"
    monkeypatch.setenv(_registry.ENV_VAR, f"{FAKE},reference")
    monkeypatch.setattr(_registry.get_backend("reference").module, "unavailable_reason", lambda device, dtype: "off")
    _registry.clear_caches()
    with pytest.raises(multisoft.BackendUnavailableError, match=f"no backend of {_registry.ENV_VAR}=.* can run "
                                                                f"cross_entropy on cpu"):
        multisoft.cross_entropy(logits, target)


def test_available_backends_and_backends_report_the_ops(softmax_only):
    assert FAKE in multisoft.available_backends("softmax")
    assert FAKE in multisoft.available_backends()
    assert FAKE not in multisoft.available_backends("cross_entropy")
    assert FAKE not in multisoft.available_backends("blocksparse")
    assert "torch" in multisoft.available_backends("cross_entropy")
    infos = {b.name: b for b in multisoft.backends(CPU)}
    assert infos[FAKE].ops == ("softmax",)
    assert infos["torch"].ops == EVERY_OP and infos["reference"].ops == EVERY_OP


def test_info_prints_the_ops(softmax_only, capsys):
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fake = next(i for i, line in enumerate(lines) if line.split()[:1] == [FAKE])
    assert lines[fake + 1].split() == ["ops:", "softmax"]
    torch_line = next(i for i, line in enumerate(lines) if line.split()[:1] == ["torch"])
    assert "ops: softmax, cross_entropy, blocksparse, log_probs" in lines[torch_line + 1]


def test_check_skips_the_ops_a_backend_lacks(softmax_only, capsys):
    assert cli.main(["check", "--backends", f"{FAKE},torch"]) == 0
    out = capsys.readouterr().out
    assert f"skipped {FAKE} for cross_entropy, blocksparse, log_probs: does not implement them" in out
    rows = [[cell.strip() for cell in line.split("|")] for line in out.splitlines() if line.count("|") == 7]
    fake_ops = {row[0].split()[0] for row in rows if row[2] == FAKE}
    assert fake_ops == {"softmax", "log_softmax"}
    assert {row[0].split()[0] for row in rows if row[2] == "torch"} == {
        "softmax", "log_softmax", "cross_entropy", "linear_cross_entropy", "blocksparse", "log_probs"}
    assert softmax_only, "the fake's softmax ran"


def test_the_harness_skips_a_backend_lacking_the_op(softmax_only):
    params = backend_params([FAKE, "torch"], "softmax", "cross_entropy")
    assert params[1] == "torch"
    (mark,) = params[0].marks
    assert params[0].values == (FAKE,) and mark.name == "skip"
    assert mark.kwargs["reason"] == f"backend '{FAKE}' does not implement cross_entropy"
    assert backend_params([FAKE, "torch"], "softmax") == [FAKE, "torch"]


def test_resolution_is_cached_per_op(softmax_only, monkeypatch):
    """One resolution per (device, dtype, op): later calls are a dict look-up."""
    resolved = []
    real = _registry._resolve

    def counting(*args):
        resolved.append(args[-1])
        return real(*args)
    monkeypatch.setattr(_registry, "_resolve", counting)
    logits, target = _ce_inputs()
    for _ in range(3):
        multisoft.softmax(torch.randn(2, 3), -1)
        multisoft.log_softmax(torch.randn(2, 3), -1)
        multisoft.cross_entropy(logits, target)
    assert resolved == ["softmax", "cross_entropy"]


def test_the_benchmark_skips_the_ops_a_backend_lacks(softmax_only, monkeypatch):
    import argparse

    from multisoft.bench import impls, run, timing

    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "make_timer", lambda warmup, rep, kind: (None, "test"))
    monkeypatch.setattr(timing, "make_eager_timer", lambda kind, rep: (None, "test"))
    runner = run.Runner(argparse.Namespace(warmup=1.0, rep=1.0, timer="queued", eager_rep=1.0, headline=False))
    impl = impls.backend_impl(FAKE)
    assert runner.skip_reason(impl, "cross_entropy", "fp32") == f"{FAKE} does not implement cross_entropy"
    assert runner.skip_reason(impl, "linear_cross_entropy", "fp32") == f"{FAKE} does not implement cross_entropy"
    assert runner.skip_reason(impl, "blocksparse_softmax", "fp32") == f"{FAKE} does not implement blocksparse"
    assert runner.skip_reason(impl, "log_softmax", "fp32") == ""
