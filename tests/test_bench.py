"""The benchmark command: its no-GPU path and its pure-python parts (bytes, plans, reports, plots), and the
committed results and shortfall reasons in benchmarks/."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multisoft import bench
from multisoft.bench import command, headline, impls, plan, records, report, run, timing

ROOT = Path(__file__).resolve().parents[1]


def _without_cuda_env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "backends"), env.get("PYTHONPATH", "")])
    return env


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_without_cuda_env(),
                          cwd=ROOT, timeout=300)


def test_without_gpu_says_so_and_fails(tmp_path):
    """It ran nothing: a script that runs the benchmark must not take that for success."""
    out = tmp_path / "results"
    done = _run("-c", f"import multisoft.bench as b; raise SystemExit(b.main(['--out', {str(out)!r}]))")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == bench.NO_GPU_MESSAGE
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_command_line_without_gpu():
    if not (ROOT / "multisoft" / "__main__.py").exists():
        pytest.skip("python -m multisoft is not there yet")
    done = _run("-m", "multisoft", "bench", "--quick")
    assert done.returncode == 1, done.stderr
    assert bench.NO_GPU_MESSAGE in done.stderr
    assert "Traceback" not in done.stderr


def test_import_is_light():
    # torch itself may import triton; multisoft.bench must add none of these.
    done = _run("-c", "import sys, torch; before = set(sys.modules); import multisoft.bench; "
                      "print(sorted(m for m in ('triton', 'matplotlib', 'cupy', 'numba', 'liger_kernel') "
                      "if m in sys.modules and m not in before))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bad_arguments_give_status_2(capsys):
    assert bench.main(["--ops", "softmax,nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert bench.main(["--dtypes", "int8"]) == 2
    assert bench.main(["--headline", "--quick"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_arguments():
    args = command.parse_args(["--ops", "blocksparse, ce,softmax", "--dtypes", "bf16", "--fp16", "--quick"])
    assert args.ops == ["blocksparse_softmax", "cross_entropy", "softmax"]
    assert args.dtypes == ["bf16", "fp16"]
    assert args.timer == "queued"
    args = command.parse_args(["--backends", "triton,torch", "--timer", "do_bench"])
    assert args.timer == "do_bench"
    assert args.ops == list(plan.OPS) and args.dtypes == ["fp32", "bf16"] and args.backends == ["triton", "torch"]
    assert (args.warmup, args.rep, args.eager_rep) == (5.0, 25.0, timing.EAGER_REP_MS)
    assert not args.headline and not args.quick
    args = command.parse_args(["--headline", "--eager-rep", "4"])
    assert args.headline and args.eager_rep == 4.0
    # nothing assumes a checkout of this repository: the results go to the current directory, no reasons file
    assert args.out == "multisoft-bench" and args.shortfalls is None


def test_a_backend_selectable_only_by_name_is_never_timed(monkeypatch, capsys):
    """A backend whose package sets AUTOMATIC = False (the float64 reference) is left out of the default set and,
    named, is not timed either (with a note); the others are timed as named."""
    import argparse
    import types

    import multisoft
    from multisoft import _registry

    package = types.ModuleType("multisoft_by_name_only")
    package.NAME, package.AUTOMATIC = "by_name_only", False
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(_registry._backends, "by_name_only", _registry.Backend("by_name_only", package.__name__))
    monkeypatch.setattr(multisoft, "available_backends", lambda: ["torch", "by_name_only"])
    backends, chosen, _ = run.choose_impls(argparse.Namespace(backends=None, no_peers=True))
    assert backends == ["torch"] and [impl.name for impl in chosen] == ["torch", "torch inplace"]
    backends, _, _ = run.choose_impls(argparse.Namespace(backends=["by_name_only", "torch"], no_peers=True))
    assert backends == ["torch"]
    assert "'by_name_only' is not timed" in capsys.readouterr().err
    package.AUTOMATIC = True
    assert run.choose_impls(argparse.Namespace(backends=None, no_peers=True))[0] == ["torch", "by_name_only"]


def test_the_commit_measured_is_named():
    commit = run.source_commit()
    assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}( \+ changes)?", commit), commit


@pytest.mark.parametrize("op, factors", [
    ("softmax", {"forward": 2, "backward": 3, "forward+backward": 5}),
    ("log_softmax", {"forward": 2, "backward": 3, "forward+backward": 5}),
    ("blocksparse_softmax", {"forward": 2, "backward": 3, "forward+backward": 5}),
    # the two-pass floor: the logits read once, the gradient written once; no backward of its own
    ("cross_entropy", {"forward": 1, "forward+backward": 2}),
])
def test_bytes_moved(op, factors):
    assert plan.OP_DIRECTIONS[op] == tuple(factors)
    for direction, factor in factors.items():
        assert plan.bytes_moved(op, direction, 1000, 2) == factor * 1000 * 2
    assert plan.bytes_moved(op, "forward", 16384 * 4096, 4) == factors["forward"] * 16384 * 4096 * 4
    assert plan.bytes_moved("cross_entropy", "forward+backward", 8192 * 32000, 2) == 2 * 8192 * 32000 * 2


def test_bytes_counted_states_the_traffic():
    assert plan.bytes_counted() == (
        "softmax, log_softmax and block-sparse (over Z·nnz·block² elements): forward 2, backward 3, "
        "forward+backward 5 × elements × element size; cross-entropy: forward 1, forward+backward 2 × M·V × element "
        "size (the logits read once, and for forward+backward the gradient written once)")


def test_gb_per_s():
    assert plan.gb_per_s(2_000_000_000, 1.0) == pytest.approx(2000.0)


def test_sweep_shapes_cover_256_to_1m_at_64m_elements():
    shapes = plan.sweep_shapes(plan.SWEEP_COLS)
    assert [n for _, n in shapes] == [2 ** k for k in range(8, 21)]
    assert all(64 << 20 <= m * n <= 128 << 20 for m, n in shapes)


def test_dense_cases_measure_a_shared_shape_once():
    cases = plan.dense_cases("softmax", plan.HEADLINE, plan.sweep_shapes(plan.SWEEP_COLS))
    labels = [c.label for c in cases]
    assert len(labels) == len(set(labels))
    assert labels[:5] == ["32768x1024", "16384x4096", "4096x32768", "1024x131072", "512x262144"]
    groups = {c.label: c.group for c in cases}
    assert groups["16384x4096"] == "headline,sweep"
    assert groups["32768x1024"] == "headline"
    assert groups["256x262144"] == "sweep"
    assert all(c.elements == c.shape[0] * c.shape[1] and c.n == c.shape[1] for c in cases)


@pytest.mark.parametrize("block, density, causal", [(16, 0.1, False), (64, 0.25, True), (128, 0.5, True)])
def test_layouts(block, density, causal):
    import torch

    layout = plan.make_layout(block, density, causal, 4, 2048)
    blocks = 2048 // block
    assert layout.shape == (4, blocks, blocks)
    assert set(layout.unique().tolist()) <= {0, 1}
    assert bool((layout.diagonal(dim1=1, dim2=2) == 1).all())
    if causal:
        assert int(layout.triu(1).sum()) == 0
    assert abs(layout.float().mean().item() - density) < 0.1
    assert torch.equal(layout, plan.make_layout(block, density, causal, 4, 2048))


def test_blocksparse_cases_count_elements():
    cases = plan.blocksparse_cases(plan.QUICK_LAYOUTS)
    assert len(cases) == len(plan.QUICK_LAYOUTS)
    for case in cases:
        z, nnz, block, _ = case.shape
        assert nnz == int(case.layout.sum()) and block == case.block
        assert case.elements == z * nnz * block * block
        assert 1 <= z <= 4 and case.elements >= plan.SWEEP_ELEMENTS // 2
    assert "causal" in cases[1].label and "causal" not in cases[0].label


def test_headline_plan_times_the_headline_cells_only():
    """--headline: softmax fp32 32768x1024 and bf16 16384x4096, cross_entropy bf16 and fp32 8192x32000, each shape
    once with its own dtypes; forward and forward+backward."""
    cases = plan.plan_cases(list(plan.OPS), quick=False, headline=True)
    assert {op: [(c.label, c.shape, c.dtypes, c.group) for c in op_cases] for op, op_cases in cases.items()} == {
        "softmax": [("32768x1024", (32768, 1024), ("fp32",), "headline"),
                    ("16384x4096", (16384, 4096), ("bf16",), "headline")],
        "cross_entropy": [("8192x32000", (8192, 32000), ("bf16", "fp32"), "headline")]}
    assert plan.HEADLINE_DIRECTIONS == ("forward", "forward+backward")
    assert plan.plan_cases(["log_softmax", "blocksparse_softmax"], quick=False, headline=True) == {}
    softmax_fp32, softmax_bf16 = cases["softmax"]
    assert run.case_dtypes(softmax_fp32, ["fp32", "bf16", "fp16"]) == ["fp32"]
    assert run.case_dtypes(softmax_bf16, ["fp32"]) == []
    assert run.case_dtypes(cases["cross_entropy"][0], ["bf16", "fp32"]) == ["bf16", "fp32"]
    # a case of the ordinary plans is timed in every dtype asked for
    ordinary = plan.plan_cases(["softmax"], quick=True)["softmax"][0]
    assert ordinary.dtypes == () and run.case_dtypes(ordinary, ["bf16", "fp16"]) == ["bf16", "fp16"]


def test_quick_plan_is_small():
    cases = plan.plan_cases(list(plan.OPS), quick=True)
    assert set(cases) == set(plan.OPS)
    assert sum(len(op_cases) for op_cases in cases.values()) <= 16


OPTIONS = {"softcap": 30.0, "lse_square_scale": 1e-4}


def test_cross_entropy_plan_adds_the_option_cases_and_keeps_the_plain_ones():
    """Beside the plain cases (labels and group as before): softcap 30 and z-loss 1e-4 at bf16 8192x128256 and fp32
    8192x32000, labelled with the options, bytes at the same two-pass floor; --quick: its one shape in every dtype;
    --headline: none."""
    cases = plan.plan_cases(["cross_entropy"], quick=False)["cross_entropy"]
    plain = [c for c in cases if not c.options]
    assert [(c.label, c.group, c.dtypes) for c in plain] == [
        ("8192x32000", "headline", ()), ("8192x128256", "headline", ()), ("4096x262144", "headline", ()),
        ("16384x151936", "headline", ())]
    assert [(c.label, c.shape, c.n, c.dtypes, c.options, c.group) for c in cases[len(plain):]] == [
        ("8192x128256 softcap=30 z=1e-4", (8192, 128256), 128256, ("bf16",), OPTIONS, "options"),
        ("8192x32000 softcap=30 z=1e-4", (8192, 32000), 32000, ("fp32",), OPTIONS, "options")]
    bf16_case = cases[len(plain)]
    assert run.case_dtypes(bf16_case, ["fp32", "bf16"]) == ["bf16"]
    assert plan.bytes_moved("cross_entropy", "forward+backward", bf16_case.elements, 2) == 2 * 8192 * 128256 * 2
    quick = plan.plan_cases(["cross_entropy"], quick=True)["cross_entropy"]
    assert [(c.label, c.dtypes, c.options) for c in quick] == [
        ("8192x32000", (), {}), ("8192x32000 softcap=30 z=1e-4", (), OPTIONS)]
    headline_cases = plan.plan_cases(["cross_entropy"], quick=False, headline=True)["cross_entropy"]
    assert [c.options for c in headline_cases] == [{}]


def _option_inputs(dtype_name="fp32"):
    """Inputs of a tiny option case on the CPU, the logits spread wide enough for the softcap to bend them."""
    import torch

    case = plan.option_cases([((8, 100), ())])[0]
    torch.manual_seed(0)
    inputs = impls.make_inputs(case, dtype_name, "cpu")
    inputs["x"] = inputs["x"] * 40
    return case, inputs


def test_an_option_case_gives_the_torch_backend_and_peer_its_options():
    """The loss and gradient of the torch backend (and its in-place call's loss) and of the torch peer on an option
    case are the float64 reference's with softcap 30 and z-loss 1e-4, which differ from those without either."""
    import torch

    from multisoft.check import reference_cross_entropy

    case, inputs = _option_inputs()
    assert inputs["options"] == OPTIONS and case.options == OPTIONS
    x, target = inputs["x"], inputs["target"]
    leaf = x.double().requires_grad_(True)
    expected = reference_cross_entropy(leaf, target, softcap=30, lse_square_scale=1e-4)
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    expected = expected.detach()
    for other in (reference_cross_entropy(x, target, softcap=30), reference_cross_entropy(x, target,
                                                                                          lse_square_scale=1e-4)):
        assert abs(float(other) - float(expected)) > 1e-3 * abs(float(expected))
    for impl in (impls.backend_impl("torch"), impls.torch_peer()):
        assert not impls.lacking_options(impl, case.options)
        own = x.detach().clone().requires_grad_(True)
        loss = impl.make("cross_entropy", inputs)(own)
        loss.backward()
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0,
                                   msg=lambda text: f"{impl.name} loss: {text}")
        torch.testing.assert_close(own.grad.double(), expected_grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda text: f"{impl.name} gradient: {text}")
    activation = x.detach().clone().requires_grad_(True).clone()
    loss = impls.inplace_impl("torch").make("cross_entropy", inputs)(activation)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    # a plain case's call is the plain F.cross_entropy
    plain = dict(inputs, options={})
    torch.testing.assert_close(impls.torch_peer().make("cross_entropy", plain)(x).double(),
                               reference_cross_entropy(x, target), rtol=1e-5, atol=0)


class _LigerFunction085:
    """Liger-Kernel 0.8.5's LigerCrossEntropyFunction as far as the benchmark sees it: its forward's signature, and
    an ``apply`` that records the positional arguments it is given."""

    calls: list = []

    @staticmethod
    def forward(ctx, _input, target, weight, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                return_predicted_tokens=False):
        raise AssertionError("called through apply only")

    @classmethod
    def apply(cls, *args):
        cls.calls.append(args)
        return args[0].sum(), None, None, None


class _LigerFunctionWithoutSoftcap(_LigerFunction085):
    calls: list = []

    @staticmethod
    def forward(ctx, _input, target, weight, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                reduction="mean"):
        raise AssertionError("called through apply only")


def _fake_liger(monkeypatch, function=None, loss_module=None):
    """Liger-Kernel importable with ``function`` as liger_kernel.ops.cross_entropy's LigerCrossEntropyFunction, or
    without that module and ``loss_module`` as liger_kernel.transformers' LigerCrossEntropyLoss; no softmax."""
    import importlib.metadata
    import types

    package, ops = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.ops")
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", ops)
    if function is not None:
        module = types.ModuleType("liger_kernel.ops.cross_entropy")
        module.LigerCrossEntropyFunction = function
        monkeypatch.setitem(sys.modules, module.__name__, module)
    if loss_module is not None:
        transformers = types.ModuleType("liger_kernel.transformers")
        transformers.LigerCrossEntropyLoss = loss_module
        monkeypatch.setitem(sys.modules, transformers.__name__, transformers)
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.8.5" if name == "liger-kernel" else version(name))


def test_liger_gets_softcap_and_z_loss_by_their_position_in_its_signature(monkeypatch):
    """LigerCrossEntropyFunction.apply(_input, target, weight, ignore_index, lse_square_scale, label_smoothing,
    reduction, softcap): an option case passes the options there, a plain case the call of before."""
    _LigerFunction085.calls = []
    _fake_liger(monkeypatch, function=_LigerFunction085)
    liger, note = impls.liger_peer()
    assert liger.name == "liger" and liger.ops == ("cross_entropy",) and note.startswith("0.8.5 (softmax: error")
    assert set(liger.options) >= {"softcap", "lse_square_scale"}
    _, inputs = _option_inputs()
    x, target = inputs["x"], inputs["target"]
    assert liger.make("cross_entropy", inputs)(x) == x.sum()
    liger.make("cross_entropy", dict(inputs, options={}))(x)
    (option_call, plain_call) = _LigerFunction085.calls
    assert option_call[0] is x and option_call[1] is target
    assert option_call[2:] == (None, -100, 1e-4, 0.0, "mean", 30.0)
    assert plain_call[2:] == (None,)


def test_liger_loss_module_gets_the_options_by_keyword(monkeypatch):
    import torch

    built = []

    class LossModule:
        def __init__(self, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
                     softcap=None):
            built.append(dict(lse_square_scale=lse_square_scale, softcap=softcap, reduction=reduction))

        def __call__(self, x, target):
            return torch.zeros(())

    _fake_liger(monkeypatch, loss_module=LossModule)
    liger, _ = impls.liger_peer()
    _, inputs = _option_inputs()
    liger.make("cross_entropy", inputs)(inputs["x"])
    assert built == [dict(lse_square_scale=1e-4, softcap=30.0, reduction="mean")]


def test_an_implementation_without_an_option_is_left_out_of_its_cases_with_the_reason(monkeypatch):
    """A Liger-Kernel whose cross-entropy takes no softcap: the option case's cells are not timed (its call never
    made), each with the reason; the plain case is timed."""
    import argparse

    _LigerFunctionWithoutSoftcap.calls = []
    _fake_liger(monkeypatch, function=_LigerFunctionWithoutSoftcap)
    liger, _ = impls.liger_peer()
    assert "softcap" not in liger.options and "lse_square_scale" in liger.options
    case, inputs = _option_inputs()
    assert impls.lacking_options(liger, case.options) == "not timed: liger takes no softcap"
    assert impls.lacking_options(liger, {}) == ""
    with pytest.raises(TypeError, match="takes no softcap"):
        liger.make("cross_entropy", inputs)
    monkeypatch.setattr(timing, "make_timer", lambda warmup, rep, kind: (lambda fn: (fn(), 1.0)[1], "test"))
    monkeypatch.setattr(timing, "make_eager_timer", lambda kind, rep: (None, "test"))
    monkeypatch.setattr(timing, "first_call_ms", lambda fn: (fn(), 1.0)[1])
    runner = run.Runner(argparse.Namespace(warmup=1.0, rep=1.0, timer="queued", eager_rep=1.0, headline=False))
    results = records.Results({}, None)
    runner.measure(liger, case, "fp32", inputs, results)
    assert [(t.shape, t.direction, t.ms, t.note) for t in results.timings] == [
        (case.label, direction, None, "not timed: liger takes no softcap") for direction in plan.OP_DIRECTIONS[
            "cross_entropy"]]
    assert _LigerFunctionWithoutSoftcap.calls == []
    plain_case = plan.dense_cases("cross_entropy", [(8, 100)], [])[0]
    runner.measure(liger, plain_case, "fp32", dict(inputs, options={}), results)
    assert [(t.shape, t.ms, t.note) for t in results.timings[2:]] == [("8x100", 1.0, "")] * 2
    assert _LigerFunctionWithoutSoftcap.calls


def _timing(op, impl, dtype, shape, direction, fraction, role="backend", group="headline", n=0, note="",
            eager=None):
    """A Timing whose kernel time reaches ``fraction`` of a 4000 GB/s copy, and its eager time ``eager``."""
    copy = 4000.0
    gbps = None if fraction is None else fraction * copy
    elements = 1 << 26
    nbytes = plan.bytes_moved(op, direction, elements, plan.ELEMENT_SIZE[dtype])
    ms = None if gbps is None else nbytes / (gbps * 1e6)
    eager_ms = None if eager is None else nbytes / (eager * copy * 1e6)
    return records.Timing(op, impl, role, dtype, group, shape, n, direction, ms, nbytes, gbps, fraction, note,
                          eager_ms, eager)


def _fake_results():
    timings = [records.Timing("copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)]
    for direction in plan.DIRECTIONS:
        timings += [
            _timing("softmax", "triton", "bf16", "16384x4096", direction, 0.91, eager=0.55),
            _timing("softmax", "cupy", "bf16", "16384x4096", direction, None, note="error: RuntimeError: boom"),
            _timing("softmax", "numba", "bf16", "16384x4096", direction, None, note="unavailable: no bf16"),
            _timing("softmax", "torch-native", "bf16", "16384x4096", direction, 0.75, role="peer", eager=0.74),
        ]
        for n, fraction in ((1024, 0.5), (4096, 0.8), (65536, 0.9)):
            timings += [
                _timing("softmax", "triton", "bf16", f"{(1 << 26) // n}x{n}", direction, fraction, group="sweep", n=n,
                        eager=fraction / 3),
                _timing("softmax", "torch-native", "bf16", f"{(1 << 26) // n}x{n}", direction, fraction / 2,
                        role="peer", group="sweep", n=n, eager=fraction / 4),
            ]
    for direction in plan.OP_DIRECTIONS["cross_entropy"]:
        timings.append(_timing("cross_entropy", "triton", "fp32", "8192x32000", direction, 0.88, eager=0.61))
        timings.append(_timing("cross_entropy", "liger", "fp32", "8192x32000", direction, 0.7, role="peer",
                               eager=0.52))
    results = records.Results({"gpu": "Fake GPU", "timing": "fake", records.BYTES_COUNTED: plan.bytes_counted()},
                              4000.0, timings)
    results.memory = [records.MemoryRecord("triton", "fp32", "8192x32000", 1000.0, 1000.0),
                      records.MemoryRecord("triton inplace", "fp32", "8192x32000", 0.5, 1000.0),
                      records.MemoryRecord("numba", "fp32", "8192x32000", None, 1000.0, "error: ImportError: x")]
    results.first_calls = [records.FirstCall("triton", "softmax", "forward", "bf16", "16384x4096", 812.5, 0.07)]
    results.host_times = [
        records.HostTime("triton", "backend", "softmax", "fp32", "8x128", "forward", 21.0, 6.5),
        records.HostTime("triton", "backend", "softmax", "fp32", "8x128", "forward+backward", 80.4),
        records.HostTime("cupy", "backend", "softmax", "fp32", "8x128", "forward", None, note="error: x"),
        records.HostTime("torch-native", "peer", "softmax", "fp32", "8x128", "forward", 9.5),
        records.HostTime("triton", "backend", "cross_entropy", "fp32", "8x128", "forward+backward", 95.0),
        records.HostTime("triton inplace", "backend", "cross_entropy", "fp32", "8x128", "forward+backward", 99.5),
        records.HostTime("liger", "peer", "cross_entropy", "fp32", "8x128", "forward+backward", 120.0),
    ]
    return results


def test_reports(tmp_path):
    results = _fake_results()
    paths = report.write_reports(results, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["environment.json", "first_calls.csv", "host_time.csv", "memory.csv", "results.md",
                     "timings.csv"]

    with open(tmp_path / "out" / "timings.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(results.timings)
    # the columns of before keep their place; the eager ones follow
    assert list(rows[0])[:13] == ["op", "impl", "role", "dtype", "group", "shape", "n", "direction", "ms", "bytes",
                                  "gb_per_s", "fraction_of_copy", "note"]
    assert list(rows[0])[13:] == ["eager_ms", "eager_fraction"]
    first = rows[1]
    assert (first["op"], first["impl"], first["direction"], first["shape"]) == \
        ("softmax", "triton", "forward", "16384x4096")
    assert float(first["fraction_of_copy"]) == pytest.approx(0.91)
    assert float(first["gb_per_s"]) == pytest.approx(3640.0)
    assert float(first["eager_fraction"]) == pytest.approx(0.55)
    assert float(first["eager_ms"]) == pytest.approx(int(first["bytes"]) / (0.55 * 4000.0 * 1e6), rel=1e-5)
    assert rows[2]["ms"] == "" and rows[2]["note"] == "error: RuntimeError: boom"
    assert rows[2]["eager_ms"] == "" and rows[2]["eager_fraction"] == ""
    with open(tmp_path / "out" / "host_time.csv", newline="") as handle:
        host = list(csv.DictReader(handle))
    assert [(r["impl"], r["op"], r["direction"]) for r in host[:2]] == [
        ("triton", "softmax", "forward"), ("triton", "softmax", "forward+backward")]
    assert float(host[0]["us"]) == 21.0 and float(host[0]["kernel_us"]) == 6.5
    assert float(host[0]["front_us"]) == pytest.approx(14.5)
    assert host[1]["kernel_us"] == "" and host[1]["front_us"] == ""
    assert host[2]["us"] == "" and host[2]["note"] == "error: x"

    text = (tmp_path / "out" / "results.md").read_text()
    assert "**4000 GB/s**" in text
    assert "**kernel / eager**" in text
    assert "## softmax" in text and "## cross_entropy" in text
    assert "| shape | dtype | triton | cupy | numba | torch-native |" in text
    assert "| 16384x4096 | bf16 | **0.91** / 0.55 | error | — | 0.75 / 0.74 |" in text
    assert "- cupy: error: RuntimeError: boom (bf16 16384x4096 forward and 2 more)" in text
    assert "- numba: unavailable: no bf16 (bf16 16384x4096 forward and 2 more)" in text
    assert text.index("- cupy: error") < text.index("- numba: unavailable")
    assert "| 8192x32000 | fp32 | **0.88** / 0.61 | 0.70 / 0.52 |" in text
    cross_entropy = text[text.index("## cross_entropy"):]
    cross_entropy = cross_entropy[:cross_entropy.index("\n## ", 1)]
    assert "**forward+backward**" in cross_entropy and "**forward**" in cross_entropy
    assert "**backward**" not in cross_entropy
    # the bytes as the run counted them, in the text (not as an environment line)
    assert f"Bytes counted: {plan.bytes_counted()}. Milliseconds" in text
    assert "- bytes counted" not in text
    assert "| 8192x32000 | fp32 | triton inplace | 0 | 0.00 |" in text
    assert "## headline: what a user gets on Fake GPU" in text and "## host time a call" in text
    assert text.index("## headline") < text.index("## softmax") < text.index("## host time a call")
    assert "| triton | softmax | forward | bf16 | 16384x4096 | 812.5 | 0.070 |" in text
    sweep = text[text.index("<details><summary>sweep"):]
    sweep = sweep[:sweep.index("</details>")]
    assert sweep.index("| 65536x1024 |") < sweep.index("| 1024x65536 |")


def test_option_cases_are_rows_of_the_cross_entropy_tables_of_their_own(tmp_path):
    """An option case's cells: rows labelled with the options in the cross-entropy tables, with a note saying what
    they time (torch-native: torch ops composed), an implementation left out with its reason below; not held to the
    targets; the plain rows and the CSV columns as without them."""
    plain_out, out = tmp_path / "plain", tmp_path / "options"
    report.write_reports(_fake_results(), plain_out)
    results = _fake_results()
    label = "8192x32000 softcap=30 z=1e-4"
    for direction in plan.OP_DIRECTIONS["cross_entropy"]:
        results.timings += [
            _timing("cross_entropy", "triton", "fp32", label, direction, 0.61, group="options", eager=0.5),
            _timing("cross_entropy", "torch-native", "fp32", label, direction, 0.2, role="peer", group="options",
                    eager=0.19),
            _timing("cross_entropy", "liger", "fp32", label, direction, None, role="peer", group="options",
                    note="not timed: liger takes no softcap")]
    report.write_reports(results, out)

    def rows(folder):
        with open(folder / "timings.csv", newline="") as handle:
            return list(csv.DictReader(handle))
    assert list(rows(out)[0]) == list(rows(plain_out)[0])
    assert [r for r in rows(out) if r["group"] != "options"] == rows(plain_out)
    text = (out / "results.md").read_text()
    cross_entropy = text[text.index("## cross_entropy"):]
    cross_entropy = cross_entropy[:cross_entropy.index("\n## ", 1)]
    forward_backward = cross_entropy[:cross_entropy.index("**forward**")]
    assert "| 8192x32000 | fp32 | **0.88** / 0.61 | 0.70 / 0.52 | — |" in forward_backward
    assert f"| {label} | fp32 | **0.61** / 0.50 | — | 0.20 / 0.19 |" in forward_backward
    assert report.options_note() in cross_entropy
    assert "`F.cross_entropy(u, target) + 0.0001 * (torch.logsumexp(u, -1) ** 2).mean()` with " \
           "`u = 30 * torch.tanh(x / 30)`" in report.options_note()
    assert f"- liger: not timed: liger takes no softcap (fp32 {label} forward and 1 more)" in cross_entropy
    assert "Rows labelled" not in (plain_out / "results.md").read_text()
    assert report.against_targets(results.timings)["triton"][1] == \
        report.against_targets(_fake_results().timings)["triton"][1]
    assert report.markdown_report(records.read_results(out)) == text


def test_targets_section_lists_the_cells_below_each_backends_target():
    forward = _timing("softmax", "triton", "bf16", "32768x1024", "forward", 0.894)     # 0.89: below
    copy = records.Timing("copy", "torch", "copy", "bf16", "headline", "32768x1024", 1024, "copy", 0.04,
                          forward.bytes, 3480.0, 0.87)
    timings = [
        copy,
        forward,
        _timing("softmax", "triton", "bf16", "32768x1024", "backward", 0.896),         # 0.90: not below
        _timing("log_softmax", "triton", "bf16", "32768x1024", "backward", 0.88),      # other bytes than the copy
        _timing("softmax", "triton", "bf16", "32768x1024", "forward+backward", 0.5),   # not held to the target
        _timing("softmax", "triton", "bf16", "256x262144", "forward", 0.5, group="sweep"),
        _timing("blocksparse_softmax", "triton", "fp32", "b16 25% Z1", "backward", 0.85, group="layout"),
        _timing("cross_entropy", "triton", "fp32", "8192x32000", "forward+backward", None, note="error: boom"),
        _timing("softmax", "numba", "bf16", "32768x1024", "forward", 0.80),
        _timing("softmax", "numba", "bf16", "32768x1024", "backward", 0.794),
        _timing("softmax", "torch-native", "bf16", "32768x1024", "forward", 0.3, role="peer"),
        _timing("softmax", "torch", "bf16", "32768x1024", "forward", 0.1),             # PyTorch's ops: no target
        _timing("cross_entropy", "numba inplace", "fp32", "8192x32000", "forward+backward", 0.81),
    ]
    text = "\n".join(report._targets_section(timings))
    assert "| triton | 0.90 | 5 | 4 | softmax forward 1, log_softmax backward 1, blocksparse_softmax backward 1, " \
           "cross_entropy forward+backward 1 |" in text
    assert "| numba | 0.80 | 2 | 1 | softmax backward 1 |" in text
    assert "| numba inplace | 0.80 | 1 | 0 |  |" in text
    assert "torch" not in text
    assert "| log_softmax | backward | 32768x1024 | bf16 | 0.88 |  |" in text
    assert "| softmax | forward | 32768x1024 | bf16 | 0.89 | a copy of its bytes reaches 0.87 |" in text
    assert "| blocksparse_softmax | backward | b16 25% Z1 | fp32 | 0.85 |  |" in text
    assert "| cross_entropy | forward+backward | 8192x32000 | fp32 | — | error: boom |" in text
    # numba's target is 0.80: the copy of these bytes (0.87) does not bound it
    assert "| softmax | backward | 32768x1024 | bf16 | 0.79 |  |" in text
    assert report._targets_section([copy]) == []


def test_reports_read_back(tmp_path):
    results = _fake_results()
    report.write_reports(results, tmp_path)
    again = records.read_results(tmp_path)
    assert again.environment == results.environment and again.copy_gb_per_s == results.copy_gb_per_s
    assert [(t.op, t.impl, t.dtype, t.shape, t.direction, t.note) for t in again.timings] == \
        [(t.op, t.impl, t.dtype, t.shape, t.direction, t.note) for t in results.timings]
    for read, written in zip(again.timings, results.timings):
        assert read.n == written.n and read.bytes == written.bytes
        for name in ("ms", "gb_per_s", "fraction_of_copy"):
            value = getattr(written, name)
            assert getattr(read, name) == (None if value is None else pytest.approx(value, rel=1e-5))
    for read, written in zip(again.timings, results.timings):
        for name in ("eager_ms", "eager_fraction"):
            value = getattr(written, name)
            assert getattr(read, name) == (None if value is None else pytest.approx(value, rel=1e-5))
    assert any(t.eager_ms is not None for t in again.timings)
    assert again.memory[2].peak_mib is None and again.memory[1].peak_mib == 0.5
    assert again.first_calls == results.first_calls and again.host_times == results.host_times
    assert report.markdown_report(again) == report.markdown_report(results)


def test_report_only_rebuilds_the_eager_columns_headline_and_host_time(tmp_path):
    """--report-only makes the same results.md as the run: kernel / eager cells, the headline summary and the
    host time a call, all read back from the CSV files."""
    out = tmp_path / "out"
    results = _fake_results()
    report.write_reports(results, out)
    (out / "results.md").unlink()
    assert bench.main(["--report-only", "--no-plots", "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    assert text == report.markdown_report(results)
    assert "| 16384x4096 | bf16 | **0.91** / 0.55 | error | — | 0.75 / 0.74 |" in text
    assert "| triton | 0.91 / 0.55 | 0.88 / 0.61 | 80 | 95 |" in text
    assert "| triton | 21.0 | 80.4 | 95.0 | 6.5 | 14.5 |" in text


def test_a_run_without_eager_times_or_host_times_reports_as_before(tmp_path):
    """CSV files of a run that took no eager times (no such columns) and no host times: kernel-only cells, in the
    headline summary too, and no host time section."""
    out = tmp_path / "out"
    results = _fake_results()
    for t in results.timings:
        t.eager_ms = t.eager_fraction = None
    results.host_times = []
    report.write_reports(results, out)
    with open(out / "timings.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    with open(out / "timings.csv", "w", newline="") as handle:   # as a run before the eager columns wrote it
        writer = csv.DictWriter(handle, [name for name in rows[0] if not name.startswith("eager")],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    text = report.markdown_report(records.read_results(out))
    assert "| 16384x4096 | bf16 | **0.91** | error | — | 0.75 |" in text
    assert "kernel / eager**. Kernel" not in text.split("## headline")[0]
    assert "| triton | 0.91 | 0.88 |" in text and "(no eager times)" in text
    assert "## host time a call" not in text and "host µs" not in text


def test_a_run_that_did_not_record_its_bytes_reports_how_they_were_counted_then(tmp_path):
    """The records of a run without a `bytes counted` entry counted cross-entropy's backward as a pass of its own
    (1, 2, 3 x M·V): results.md made from them says so, not today's count."""
    out = tmp_path / "out"
    results = _fake_results()
    del results.environment[records.BYTES_COUNTED]
    report.write_reports(results, out)
    text = report.markdown_report(records.read_results(out))
    assert "cross-entropy: 1, 2, 3 × M·V × element size. A fused implementation can pass 1.0 on " \
           "forward+backward. Milliseconds" in text
    assert plan.bytes_counted() not in text


def test_headline_section_from_synthetic_records():
    """The headline summary: forward+backward of the headline cells that were timed, kernel / eager of each
    implementation, then its host µs a forward+backward call of each op; other cells and directions left out."""
    direction = "forward+backward"
    cells = [("softmax", "fp32", "32768x1024"), ("softmax", "bf16", "16384x4096"),
             ("cross_entropy", "fp32", "8192x32000")]
    fed = {  # (impl, role): {cell: (kernel, eager)}; None: an error
        ("triton", "backend"): {cells[0]: (0.93, 0.61), cells[1]: (0.91, 0.55), cells[2]: (0.88, 0.605)},
        ("cupy", "backend"): {cells[1]: None},
        ("triton inplace", "backend"): {cells[2]: (1.2, 0.9)},
        ("torch-native", "peer"): {cells[0]: (0.8, 0.79), cells[1]: (0.75, 0.744)},
        ("liger", "peer"): {cells[2]: (0.7, 0.52)},
    }
    host_fed = {("triton", "softmax"): 80.4, ("triton", "cross_entropy"): 95.0, ("torch-native", "softmax"): 30.2,
                ("liger", "cross_entropy"): 120.0, ("cupy", "softmax"): None}
    timings = [records.Timing("copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)]
    for (impl, role), values in fed.items():
        for (op, dtype, shape), value in values.items():
            if value is None:
                timings.append(_timing(op, impl, dtype, shape, direction, None, role=role, note="error: boom"))
            else:
                timings.append(_timing(op, impl, dtype, shape, direction, value[0], role=role, eager=value[1]))
    timings += [_timing("softmax", "triton", "fp32", "32768x1024", "forward", 0.99, eager=0.98),
                _timing("softmax", "triton", "fp32", "1024x131072", direction, 0.5, eager=0.4),
                _timing("cross_entropy", "triton", "fp32", "8192x128256", direction, 0.97, eager=0.96)]
    results = records.Results({"gpu": "Fake GPU"}, 4000.0, timings)
    roles = dict(fed.keys())
    results.host_times = [records.HostTime("triton", "backend", "softmax", "fp32", "8x128", "forward", 21.0, 6.5)]
    for (impl, op), us in host_fed.items():
        results.host_times.append(records.HostTime(impl, roles[impl], op, "fp32", "8x128", direction, us,
                                                   note="" if us is not None else "error: x"))
    lines = headline.headline_section(results)
    assert lines[0] == "## headline: what a user gets on Fake GPU"
    assert "forward+backward, as a fraction of the copy bandwidth (4000 GB/s)" in lines[2]
    assert "(input 8x128 fp32)" in lines[2]
    start = lines.index(next(line for line in lines if line.startswith("| impl |")))
    expected = ["| impl | " + " | ".join(" ".join(cell) for cell in cells) + " | host µs softmax | host µs "
                "cross_entropy |", "|---|" + "---:|" * 5]
    for impl, role in fed:  # backends, then peers, each in the order fed
        row = []
        for cell in cells:
            if cell not in fed[(impl, role)]:
                row.append("—")
            elif fed[(impl, role)][cell] is None:
                row.append("error")
            else:
                row.append("{:.2f} / {:.2f}".format(*fed[(impl, role)][cell]))
        for op in ("softmax", "cross_entropy"):
            us = host_fed.get((impl, op), "absent")
            row.append("—" if us == "absent" else "error" if us is None else f"{us:.0f}")
        expected.append(f"| {impl} | " + " | ".join(row) + " |")
    assert lines[start:start + len(expected)] == expected
    assert lines[start + len(expected):] == [""]
    # no headline cell timed: no section
    assert headline.headline_section(records.Results({}, 4000.0, timings[-2:])) == []


def test_host_time_section_from_synthetic_records():
    fed = [("triton", "backend", "softmax", "forward", 21.0, 6.5), ("triton", "backend", "softmax",
                                                                    "forward+backward", 80.4, None),
           ("triton", "backend", "cross_entropy", "forward+backward", 95.0, None),
           ("torch-native", "peer", "softmax", "forward", 9.5, None),
           ("cupy", "backend", "softmax", "forward", None, None),
           ("triton inplace", "backend", "cross_entropy", "forward+backward", 99.5, None)]
    host_times = [records.HostTime(impl, role, op, "fp32", "8x128", direction, us, kernel,
                                   note="" if us is not None else "error: RuntimeError: no")
                  for impl, role, op, direction, us, kernel in fed]
    lines = headline.host_time_section(host_times)
    assert lines[0] == "## host time a call"
    assert "(input 8x128 fp32)" in lines[2]
    columns = [("softmax", "forward"), ("softmax", "forward+backward"), ("cross_entropy", "forward+backward")]
    expected = ["| impl | " + " | ".join(f"{op} {direction}" for op, direction in columns)
                + " | softmax forward, kernel alone | front |", "|---|" + "---:|" * 5]
    for impl in ("triton", "cupy", "triton inplace", "torch-native"):
        values = {(op, direction): (us, kernel) for name, _, op, direction, us, kernel in fed if name == impl}
        row = []
        for column in columns:
            us = values.get(column, ("absent",))[0]
            row.append("—" if us == "absent" else "error" if us is None else f"{us:.1f}")
        kernel = values.get(("softmax", "forward"), (None, None))
        if kernel[1] is None:
            row += ["—", "—"]
        else:
            row += [f"{kernel[1]:.1f}", f"{kernel[0] - kernel[1]:.1f}"]
        expected.append(f"| {impl} | " + " | ".join(row) + " |")
    start = lines.index(expected[0])
    assert lines[start:start + len(expected)] == expected
    assert lines[start + len(expected):] == ["", "- cupy softmax forward: error: RuntimeError: no", ""]
    assert headline.host_time_section([]) == []


def _write_shortfalls(path, rows):
    path.write_text("# why cells fall short\n" + ",".join(records.SHORTFALL_COLUMNS) + "\n"
                    + "".join(",".join(row) + "\n" for row in rows))
    return path


def test_shortfalls_give_each_cell_below_its_reason(tmp_path):
    shortfalls = records.load_shortfalls(_write_shortfalls(tmp_path / "s.csv", [
        ("triton", "*softmax", "forward", "bf16", "*x512|*x1024", "short rows"),
        ("*", "blocksparse_softmax", "*", "*", "b16 *", "small blocks"),
        ("triton", "softmax", "forward", "*", "*", "never reached: the first row matches first"),
    ]))
    forward = _timing("softmax", "triton", "bf16", "32768x1024", "forward", 0.894)
    copy = records.Timing("copy", "torch", "copy", "bf16", "headline", "32768x1024", 1024, "copy", 0.04,
                          forward.bytes, 3480.0, 0.87)
    timings = [copy, forward,
               _timing("log_softmax", "triton", "bf16", "32768x1024", "forward", 0.80),
               _timing("blocksparse_softmax", "numba", "fp32", "b16 25% Z1", "backward", 0.70, group="layout"),
               _timing("softmax", "triton", "fp32", "1024x131072", "backward", 0.85),
               _timing("softmax", "triton", "fp32", "1024x131072", "forward", None, note="error: boom")]
    text = "\n".join(report._targets_section(timings, shortfalls))
    assert "| softmax | forward | 32768x1024 | bf16 | 0.89 | a copy of its bytes reaches 0.87; short rows |" in text
    assert "| log_softmax | forward | 32768x1024 | bf16 | 0.80 | a copy of its bytes reaches 0.87; short rows |" in text
    assert "| blocksparse_softmax | backward | b16 25% Z1 | fp32 | 0.70 | small blocks |" in text
    assert f"| softmax | backward | 1024x131072 | fp32 | 0.85 | {report.NO_REASON} |" in text
    assert "| softmax | forward | 1024x131072 | fp32 | — | error: boom |" in text
    assert "never reached" not in text
    assert "the note of each cell below" in text
    # without a shortfalls file the cells keep the run's own notes only
    assert report.NO_REASON not in "\n".join(report._targets_section(timings))


def test_load_shortfalls_names_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError):
        records.load_shortfalls(tmp_path / "none.csv")
    (tmp_path / "columns.csv").write_text("impl,op,why\ntriton,softmax,x\n")
    with pytest.raises(ValueError, match="columns must be impl,op,direction,dtype,shape,why"):
        records.load_shortfalls(tmp_path / "columns.csv")
    short = _write_shortfalls(tmp_path / "short.csv", [("triton", "softmax", "forward", "bf16", "*", "")])
    with pytest.raises(ValueError, match="row 2 .* needs a value"):
        records.load_shortfalls(short)


def test_report_only_writes_results_md_again(tmp_path, capsys):
    out = tmp_path / "out"
    results = _fake_results()
    results.timings.append(_timing("softmax", "triton", "fp32", "1024x131072", "forward", 0.5))
    report.write_reports(results, out)
    shortfalls = _write_shortfalls(tmp_path / "s.csv", [("triton", "softmax", "*", "*", "*x131072", "long rows")])
    assert "long rows" not in (out / "results.md").read_text()
    timings_csv = (out / "timings.csv").read_text()
    assert bench.main(["--report-only", "--no-plots", "--out", str(out), "--shortfalls", str(shortfalls)]) == 0
    assert (out / "timings.csv").read_text() == timings_csv
    assert "| softmax | forward | 1024x131072 | fp32 | 0.50 | long rows |" in (out / "results.md").read_text()
    (out / records.ENVIRONMENT_FILE).unlink()
    assert bench.main(["--report-only", "--no-plots", "--out", str(out)]) == 2
    assert "environment.json not found" in capsys.readouterr().err


RESULTS = ROOT / "benchmarks" / "results"
SHORTFALLS = ROOT / "benchmarks" / "shortfalls.csv"
TUNING = ROOT / "docs" / "tuning.md"
# A shortfall reason ends by citing where it was measured: a section of docs/tuning.md and the commits.
CITATION = re.compile(r"\((docs/tuning\.md#[a-z0-9-]+)((?:, [0-9a-f]{7,40})+)\)$")


def test_the_committed_results_give_a_reason_for_every_cell_below_its_target():
    """Every cell of benchmarks/results/ below its target takes its reason from a row of benchmarks/shortfalls.csv
    (the first that matches it), every row is that for some cell (none stale or shadowed), and results.md is what
    the report makes of the two."""
    shortfalls = records.load_shortfalls(SHORTFALLS)
    results = records.read_results(RESULTS)
    below = [t for _, _, cells in report.against_targets(results.timings).values() for t in cells if not t.note]
    first = [records.first_shortfall(shortfalls, t) for t in below]
    assert [(t.impl, t.op, t.direction, t.dtype, t.shape) for t, s in zip(below, first) if s is None] == []
    assert [s for s in shortfalls if s not in first] == []
    assert (RESULTS / "results.md").read_text() == report.markdown_report(results, shortfalls)


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _not_in_history(hashes) -> list[str] | None:
    """The hashes that name no commit of this repository; None when git or the full history is not here."""
    try:
        shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return None
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], capture_output=True, text=True,
                               input="".join(f"{h}^{{commit}}\n" for h in hashes), timeout=30)
    except OSError:
        return None
    # a commit's line is "<full hash> commit <size>"; anything else ("<hash> missing", "ambiguous") is not one
    return [h for h, line in zip(hashes, found.stdout.splitlines()) if line.split()[1:2] != ["commit"]]


def test_shortfall_reasons_cite_a_section_of_docs_tuning_and_commits():
    anchors = _anchors(TUNING.read_text())
    for shortfall in records.load_shortfalls(SHORTFALLS):
        cited = CITATION.search(shortfall.why)
        assert cited, f"{shortfall.why!r} does not end with (docs/tuning.md#section, commit, ...)"
        assert cited.group(1).split("#")[1] in anchors, cited.group(1)
    assert _anchors("## Triton: softmax\n### CuPy, block-sparse (staged)\n") == {
        "triton-softmax", "cupy-block-sparse-staged"}


def test_the_cited_commits_are_in_the_history():
    hashes = re.findall(r"`([0-9a-f]{7,12})`", TUNING.read_text())
    for shortfall in records.load_shortfalls(SHORTFALLS):
        hashes += CITATION.search(shortfall.why).group(2).strip(", ").split(", ")
    assert len(hashes) > 20
    missing = _not_in_history(sorted(set(hashes)) + ["0000000"])
    if missing is None:
        pytest.skip("no git history here (a shallow clone, or no git)")
    assert missing == ["0000000"]  # a hash that names nothing is reported


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from multisoft.bench import plots

    paths = plots.write_plots(_fake_results(), tmp_path)
    assert sorted(p.name for p in paths) == ["fraction_of_copy.png", "sweep_softmax.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
