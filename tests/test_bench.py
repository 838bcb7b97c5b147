"""The benchmark command: its no-GPU path and its pure-python parts (bytes, plans, reports, plots)."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multisoft import bench

ROOT = Path(__file__).resolve().parents[1]


def _without_cuda_env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "backends"), env.get("PYTHONPATH", "")])
    return env


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_without_cuda_env(),
                          cwd=ROOT, timeout=300)


def test_without_gpu_says_so_and_exits_zero(tmp_path):
    out = tmp_path / "results"
    done = _run("-c", f"import multisoft.bench as b; raise SystemExit(b.main(['--out', {str(out)!r}]))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == bench.NO_GPU_MESSAGE
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_command_line_without_gpu():
    if not (ROOT / "multisoft" / "__main__.py").exists():
        pytest.skip("python -m multisoft is not there yet")
    done = _run("-m", "multisoft", "bench", "--quick")
    assert done.returncode == 0, done.stderr
    assert bench.NO_GPU_MESSAGE in done.stdout
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


def test_arguments():
    args = bench.parse_args(["--ops", "blocksparse, ce,softmax", "--dtypes", "bf16", "--fp16", "--quick"])
    assert args.ops == ["blocksparse_softmax", "cross_entropy", "softmax"]
    assert args.dtypes == ["bf16", "fp16"]
    assert args.timer == "queued"
    args = bench.parse_args(["--backends", "triton,torch", "--timer", "do_bench"])
    assert args.timer == "do_bench"
    assert args.ops == list(bench.OPS) and args.dtypes == ["fp32", "bf16"] and args.backends == ["triton", "torch"]
    assert (args.warmup, args.rep) == (5.0, 25.0)


@pytest.mark.parametrize("op, factors", [
    ("softmax", (2, 3, 5)), ("log_softmax", (2, 3, 5)), ("blocksparse_softmax", (2, 3, 5)),
    ("cross_entropy", (1, 2, 3)),
])
def test_bytes_moved(op, factors):
    for direction, factor in zip(bench.DIRECTIONS, factors):
        assert bench.bytes_moved(op, direction, 1000, 2) == factor * 1000 * 2
    assert bench.bytes_moved(op, "forward", 16384 * 4096, 4) == factors[0] * 16384 * 4096 * 4


def test_gb_per_s():
    assert bench.gb_per_s(2_000_000_000, 1.0) == pytest.approx(2000.0)


def test_sweep_shapes_cover_256_to_1m_at_64m_elements():
    shapes = bench.sweep_shapes(bench.SWEEP_COLS)
    assert [n for _, n in shapes] == [2 ** k for k in range(8, 21)]
    assert all(64 << 20 <= m * n <= 128 << 20 for m, n in shapes)


def test_dense_cases_measure_a_shared_shape_once():
    cases = bench.dense_cases("softmax", bench.HEADLINE, bench.sweep_shapes(bench.SWEEP_COLS))
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

    layout = bench.make_layout(block, density, causal, 4, 2048)
    blocks = 2048 // block
    assert layout.shape == (4, blocks, blocks)
    assert set(layout.unique().tolist()) <= {0, 1}
    assert bool((layout.diagonal(dim1=1, dim2=2) == 1).all())
    if causal:
        assert int(layout.triu(1).sum()) == 0
    assert abs(layout.float().mean().item() - density) < 0.1
    assert torch.equal(layout, bench.make_layout(block, density, causal, 4, 2048))


def test_blocksparse_cases_count_elements():
    cases = bench.blocksparse_cases(bench.QUICK_LAYOUTS)
    assert len(cases) == len(bench.QUICK_LAYOUTS)
    for case in cases:
        z, nnz, block, _ = case.shape
        assert nnz == int(case.layout.sum()) and block == case.block
        assert case.elements == z * nnz * block * block
        assert 1 <= z <= 4 and case.elements >= bench.SWEEP_ELEMENTS // 2
    assert "causal" in cases[1].label and "causal" not in cases[0].label


def test_quick_plan_is_small():
    plan = bench.plan_cases(list(bench.OPS), quick=True)
    assert set(plan) == set(bench.OPS)
    assert sum(len(cases) for cases in plan.values()) <= 16


def _timing(op, impl, dtype, shape, direction, fraction, role="backend", group="headline", n=0, note=""):
    copy = 4000.0
    gbps = None if fraction is None else fraction * copy
    elements = 1 << 26
    nbytes = bench.bytes_moved(op, direction, elements, bench.ELEMENT_SIZE[dtype])
    ms = None if gbps is None else nbytes / (gbps * 1e6)
    return bench.Timing(op, impl, role, dtype, group, shape, n, direction, ms, nbytes, gbps, fraction, note)


def _fake_results():
    timings = [bench.Timing("copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)]
    for direction in bench.DIRECTIONS:
        timings += [
            _timing("softmax", "triton", "bf16", "16384x4096", direction, 0.91),
            _timing("softmax", "cupy", "bf16", "16384x4096", direction, None, note="error: RuntimeError: boom"),
            _timing("softmax", "numba", "bf16", "16384x4096", direction, None, note="unavailable: no bf16"),
            _timing("softmax", "torch-native", "bf16", "16384x4096", direction, 0.75, role="peer"),
        ]
        for n, fraction in ((1024, 0.5), (4096, 0.8), (65536, 0.9)):
            timings += [
                _timing("softmax", "triton", "bf16", f"{(1 << 26) // n}x{n}", direction, fraction, group="sweep", n=n),
                _timing("softmax", "torch-native", "bf16", f"{(1 << 26) // n}x{n}", direction, fraction / 2,
                        role="peer", group="sweep", n=n),
            ]
        timings.append(_timing("cross_entropy", "triton", "fp32", "8192x32000", direction, 0.88))
        liger_note = "Liger computes the gradient in its forward" if direction == "backward" else ""
        timings.append(_timing("cross_entropy", "liger", "fp32", "8192x32000", direction,
                               None if liger_note else 0.7, role="peer", note=liger_note))
    results = bench.Results({"gpu": "Fake GPU", "timing": "fake"}, 4000.0, timings)
    results.memory = [bench.MemoryRecord("triton", "fp32", "8192x32000", 1000.0, 1000.0),
                      bench.MemoryRecord("triton inplace", "fp32", "8192x32000", 0.5, 1000.0),
                      bench.MemoryRecord("numba", "fp32", "8192x32000", None, 1000.0, "error: ImportError: x")]
    results.first_calls = [bench.FirstCall("triton", "softmax", "forward", "bf16", "16384x4096", 812.5, 0.07)]
    results.overhead = [bench.Overhead("triton", 21.0, 6.5), bench.Overhead("cupy", None, None, "error: x")]
    return results


def test_reports(tmp_path):
    results = _fake_results()
    paths = bench.write_reports(results, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["environment.json", "first_calls.csv", "memory.csv", "overhead.csv", "results.md", "timings.csv"]

    with open(tmp_path / "out" / "timings.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(results.timings)
    first = rows[1]
    assert (first["op"], first["impl"], first["direction"], first["shape"]) == \
        ("softmax", "triton", "forward", "16384x4096")
    assert float(first["fraction_of_copy"]) == pytest.approx(0.91)
    assert float(first["gb_per_s"]) == pytest.approx(3640.0)
    assert rows[2]["ms"] == "" and rows[2]["note"] == "error: RuntimeError: boom"
    with open(tmp_path / "out" / "overhead.csv", newline="") as handle:
        overhead = list(csv.DictReader(handle))
    assert float(overhead[0]["difference_us"]) == pytest.approx(14.5)
    assert overhead[1]["difference_us"] == ""

    text = (tmp_path / "out" / "results.md").read_text()
    assert "**4000 GB/s**" in text
    assert "## softmax" in text and "## cross_entropy" in text
    assert "| shape | dtype | triton | cupy | numba | torch-native |" in text
    assert "| 16384x4096 | bf16 | **0.91** | error | — | 0.75 |" in text
    assert "- cupy: error: RuntimeError: boom (bf16 16384x4096 forward and 2 more)" in text
    assert "- numba: unavailable: no bf16 (bf16 16384x4096 forward and 2 more)" in text
    assert text.index("- cupy: error") < text.index("- numba: unavailable")
    assert "| 8192x32000 | fp32 | **0.88** | 0.70 |" in text
    assert "| 8192x32000 | fp32 | 0.88 | — |" in text
    assert "| 8192x32000 | fp32 | triton inplace | 0 | 0.00 |" in text
    assert "| triton | 21.0 | 6.5 | 14.5 |" in text
    assert "| triton | softmax | forward | bf16 | 16384x4096 | 812.5 | 0.070 |" in text
    sweep = text[text.index("<details><summary>sweep"):]
    sweep = sweep[:sweep.index("</details>")]
    assert sweep.index("| 65536x1024 |") < sweep.index("| 1024x65536 |")


def test_targets_section_lists_the_cells_below_each_backends_target():
    forward = _timing("softmax", "triton", "bf16", "32768x1024", "forward", 0.894)     # 0.89: below
    copy = bench.Timing("copy", "torch", "copy", "bf16", "headline", "32768x1024", 1024, "copy", 0.04,
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
        _timing("softmax", "torch", "bf16", "32768x1024", "forward", 0.1),             # the reference: no target
        _timing("cross_entropy", "numba inplace", "fp32", "8192x32000", "forward+backward", 0.81),
    ]
    text = "\n".join(bench._targets_section(timings))
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
    assert bench._targets_section([copy]) == []


def test_reports_read_back(tmp_path):
    results = _fake_results()
    bench.write_reports(results, tmp_path)
    again = bench.read_results(tmp_path)
    assert again.environment == results.environment and again.copy_gb_per_s == results.copy_gb_per_s
    assert [(t.op, t.impl, t.dtype, t.shape, t.direction, t.note) for t in again.timings] == \
        [(t.op, t.impl, t.dtype, t.shape, t.direction, t.note) for t in results.timings]
    for read, written in zip(again.timings, results.timings):
        assert read.n == written.n and read.bytes == written.bytes
        for name in ("ms", "gb_per_s", "fraction_of_copy"):
            value = getattr(written, name)
            assert getattr(read, name) == (None if value is None else pytest.approx(value, rel=1e-5))
    assert again.memory[2].peak_mib is None and again.memory[1].peak_mib == 0.5
    assert again.first_calls == results.first_calls and again.overhead == results.overhead
    assert bench.markdown_report(again) == bench.markdown_report(results)


def _write_shortfalls(path, rows):
    path.write_text("# why cells fall short\n" + ",".join(bench.SHORTFALL_COLUMNS) + "\n"
                    + "".join(",".join(row) + "\n" for row in rows))
    return path


def test_shortfalls_give_each_cell_below_its_reason(tmp_path):
    shortfalls = bench.load_shortfalls(_write_shortfalls(tmp_path / "s.csv", [
        ("triton", "*softmax", "forward", "bf16", "*x512|*x1024", "short rows"),
        ("*", "blocksparse_softmax", "*", "*", "b16 *", "small blocks"),
        ("triton", "softmax", "forward", "*", "*", "never reached: the first row matches first"),
    ]))
    forward = _timing("softmax", "triton", "bf16", "32768x1024", "forward", 0.894)
    copy = bench.Timing("copy", "torch", "copy", "bf16", "headline", "32768x1024", 1024, "copy", 0.04,
                        forward.bytes, 3480.0, 0.87)
    timings = [copy, forward,
               _timing("log_softmax", "triton", "bf16", "32768x1024", "forward", 0.80),
               _timing("blocksparse_softmax", "numba", "fp32", "b16 25% Z1", "backward", 0.70, group="layout"),
               _timing("softmax", "triton", "fp32", "1024x131072", "backward", 0.85),
               _timing("softmax", "triton", "fp32", "1024x131072", "forward", None, note="error: boom")]
    text = "\n".join(bench._targets_section(timings, shortfalls))
    assert "| softmax | forward | 32768x1024 | bf16 | 0.89 | a copy of its bytes reaches 0.87; short rows |" in text
    assert "| log_softmax | forward | 32768x1024 | bf16 | 0.80 | a copy of its bytes reaches 0.87; short rows |" in text
    assert "| blocksparse_softmax | backward | b16 25% Z1 | fp32 | 0.70 | small blocks |" in text
    assert f"| softmax | backward | 1024x131072 | fp32 | 0.85 | {bench.NO_REASON} |" in text
    assert "| softmax | forward | 1024x131072 | fp32 | — | error: boom |" in text
    assert "never reached" not in text
    assert "the note of each cell below" in text
    # without a shortfalls file the cells keep the run's own notes only
    assert bench.NO_REASON not in "\n".join(bench._targets_section(timings))


def test_load_shortfalls_names_what_is_wrong(tmp_path):
    assert bench.load_shortfalls(tmp_path / "none.csv") is None
    (tmp_path / "columns.csv").write_text("impl,op,why\ntriton,softmax,x\n")
    with pytest.raises(ValueError, match="columns must be impl,op,direction,dtype,shape,why"):
        bench.load_shortfalls(tmp_path / "columns.csv")
    short = _write_shortfalls(tmp_path / "short.csv", [("triton", "softmax", "forward", "bf16", "*", "")])
    with pytest.raises(ValueError, match="row 2 .* needs a value"):
        bench.load_shortfalls(short)


def test_report_only_writes_results_md_again(tmp_path, capsys):
    out = tmp_path / "out"
    results = _fake_results()
    results.timings.append(_timing("softmax", "triton", "fp32", "1024x131072", "forward", 0.5))
    bench.write_reports(results, out)
    shortfalls = _write_shortfalls(tmp_path / "s.csv", [("triton", "softmax", "*", "*", "*x131072", "long rows")])
    assert "long rows" not in (out / "results.md").read_text()
    timings_csv = (out / "timings.csv").read_text()
    assert bench.main(["--report-only", "--no-plots", "--out", str(out), "--shortfalls", str(shortfalls)]) == 0
    assert (out / "timings.csv").read_text() == timings_csv
    assert "| softmax | forward | 1024x131072 | fp32 | 0.50 | long rows |" in (out / "results.md").read_text()
    (out / bench.ENVIRONMENT_FILE).unlink()
    assert bench.main(["--report-only", "--no-plots", "--out", str(out)]) == 2
    assert "environment.json not found" in capsys.readouterr().err


def test_the_committed_results_give_a_reason_for_every_cell_below_its_target():
    """The issues ask for the cells that fall short to stay in the results with the reason found: every cell of
    benchmarks/results/ below its target takes its reason from a row of benchmarks/shortfalls.csv (the first that
    matches it), and every row is that for some cell (none stale or shadowed)."""
    shortfalls = bench.load_shortfalls(ROOT / bench.SHORTFALLS)
    results = bench.read_results(ROOT / "benchmarks" / "results")
    below = [t for _, _, cells in bench.against_targets(results.timings).values() for t in cells if not t.note]
    assert below
    first = [bench.first_shortfall(shortfalls, t) for t in below]
    assert [(t.impl, t.op, t.direction, t.dtype, t.shape) for t, s in zip(below, first) if s is None] == []
    assert [s for s in shortfalls if s not in first] == []
    named = {name for s in shortfalls for name in re.findall(r"[\w*.-]+\.txt", s.why)}
    assert named and [name for name in named if not list((ROOT / "benchmarks/results/tuning").glob(name))] == []
    assert (ROOT / "benchmarks" / "results" / "results.md").read_text() == bench.markdown_report(results, shortfalls)


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from multisoft import _plots

    paths = _plots.write_plots(_fake_results(), tmp_path)
    assert sorted(p.name for p in paths) == ["fraction_of_copy.png", "sweep_softmax.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000


def _wall_ms(fn):
    import time

    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


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


def test_dry_run_on_cpu(tmp_path, monkeypatch):
    """The whole run on the CPU with tiny shapes and a wall-clock timer: the pipeline, not the numbers."""
    import types

    import torch

    from multisoft import _registry

    for name, value in {"DEVICE": "cpu", "COPY_BYTES": 1 << 20, "QUICK_HEADLINE": [(8, 64)],
                        "QUICK_SWEEP_COLS": [32, 64, 128], "SWEEP_ELEMENTS": 512,
                        "QUICK_CROSS_ENTROPY": [(8, 100)], "QUICK_LAYOUTS": [(16, 0.5, False), (16, 0.5, True)],
                        "HEADS": 2, "SEQ": 64}.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "make_timer", lambda warmup, rep, kind: (_wall_ms, "wall clock (test)"))
    monkeypatch.setattr(bench, "liger_peer", lambda: (None, "hidden by the test"))  # its kernels need a GPU
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

    out = tmp_path / "res"
    assert bench.main(["--quick", "--backends", "torch,failing,broken", "--out", str(out)]) == 0

    with open(out / "timings.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    ops = {r["op"] for r in rows}
    assert ops == {"copy", "softmax", "log_softmax", "cross_entropy", "blocksparse_softmax"}
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert torch_rows and all(float(r["ms"]) > 0 and float(r["fraction_of_copy"]) > 0 for r in torch_rows)
    # 3 shapes per dense op (headline, 2 sweep), 2 dtypes, 3 directions
    assert len([r for r in torch_rows if r["op"] == "softmax"]) == 3 * 2 * 3
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
    assert [r["direction"] for r in inplace] == ["forward+backward"] * 2 and all(r["ms"] for r in inplace)
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
    with open(out / "overhead.csv", newline="") as handle:
        overhead = {r["impl"]: r for r in csv.DictReader(handle)}
    assert float(overhead["torch"]["api_us"]) > 0 and float(overhead["torch"]["direct_us"]) > 0
    assert "kernel exploded" in overhead["failing"]["note"]
    text = (out / "results.md").read_text()
    for op in ("softmax", "log_softmax", "cross_entropy", "blocksparse_softmax"):
        assert f"## {op}" in text
    assert "kernel exploded" in text
    assert "## copy of each headline shape's bytes" in text and "| 8x100 | bf16 |" in text


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
        monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: self.host / 1e3))
        monkeypatch.setattr(bench, "_sleep_cycles_per_ms", [])


@pytest.mark.parametrize("filtered", [True, False])
def test_queued_bench_leaves_out_calls_that_timed_the_host(monkeypatch, filtered):
    """A call costing the host 0.5 ms and the GPU 0.24, with the sleep calibrated at an eighth of the clock it then
    runs at (as on a GPU calibrated while it idled: every hold an eighth as long as meant): most calls of a batch
    begin on the GPU before the host has queued them and time the host. queued_bench leaves those out, holds longer
    and gives the GPU's time; without that (filtered=False: no doubling allowed) the median is the host's, which
    shows that the test tells the two apart."""
    line = _Timeline(cycles_per_ms=1000.0)
    line.patch(monkeypatch)
    bench._hold_gpu(1.0)          # calibrates the sleep
    line.synchronize()
    line.cycles_per_ms *= 8       # the GPU clocks up: every hold runs an eighth as long

    def call():
        line.host += 0.5 - line.LAUNCH
        line.launch(0.24)

    if not filtered:
        monkeypatch.setattr(bench, "HOLD_MARGIN_MAX", 0.0)
    ms = bench.queued_bench(call, warmup=5.0, rep=25.0)
    if filtered:
        assert ms == pytest.approx(0.24 + line.LAUNCH, abs=0.01)
    else:
        assert ms > 0.4


def test_queued_bench_ends_for_a_call_that_synchronises(monkeypatch):
    """Every call of one that synchronises inside times the host, and the host waits out every hold: the times are
    kept as they are from the first batch on, and no hold grows (on the H200, with the doubling holds, torch's
    cross-entropy at 8192 x 128256 took a minute a cell; a call waiting on the GPU is the inferred cause)."""
    line = _Timeline(cycles_per_ms=1000.0)
    line.patch(monkeypatch)
    holds = []
    hold = bench._hold_gpu
    monkeypatch.setattr(bench, "_hold_gpu", lambda ms: (holds.append(ms), hold(ms)))

    def call():
        line.launch(0.1)
        line.synchronize()
        line.host += 0.3

    assert bench.queued_bench(call, warmup=5.0, rep=25.0) > 0.3
    batches = holds[2:]   # after the calibration's and the first estimate's
    assert batches and max(batches) <= batches[0] * (1 + 1e-9)


def test_triton_resources_compiles_for_sm90_without_a_gpu():
    """benchmarks/tune/triton_resources.py: every configuration compiles with triton's own ptxas and
    cuobjdump, no GPU, no interpreter (a kernel whose signature changed fails here)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton ships no cuobjdump")
    env = _without_cuda_env()
    env.pop("TRITON_INTERPRET", None)
    tool = "benchmarks/tune/triton_resources.py"
    done = subprocess.run([sys.executable, tool], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:]}
    assert {"softmax-fwd-split-bf16-4096", "cross_entropy-fwd-loop-fp32", "blocksparse-bwd-b64x16-bf16"} <= set(rows)
    _, warps, regs, spills, programs = rows["softmax-fwd-tile-fp32-1024"].split()[:5]
    assert int(warps) == 4 and 0 < int(regs) <= 255 and spills == "0/0" and 1 <= int(programs) <= 16
    # the split forward's register cap (SPLIT_FORWARD_MAXNREG) is compiled in
    from multisoft_triton.softmax import SPLIT_FORWARD_MAXNREG

    assert int(rows["softmax-fwd-split-fp32-4096"].split()[2]) <= SPLIT_FORWARD_MAXNREG[4]
    # 16-byte accesses: the launcher's alignment of pointers and row lengths is modelled
    assert "LDG.E.128" in rows["softmax-fwd-tile-fp32-1024"] and "STG.E.128" in rows["softmax-fwd-tile-fp32-1024"]
    refused = subprocess.run([sys.executable, tool], capture_output=True, text=True,
                             env=dict(env, TRITON_INTERPRET="1"), cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and "TRITON_INTERPRET" in refused.stderr


def test_tune_variants_are_undone_and_unknown_settings_named(monkeypatch):
    """benchmarks/tune/tune.py: a variant's assignments are undone before the next one, and a variant that
    sets a constant its module does not have (misspelt or renamed) is named instead of timing the defaults."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("tune_tool", ROOT / "benchmarks" / "tune" / "tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    module = types.ModuleType("fake_backend_settings")
    module.CHUNK = 4096
    monkeypatch.setitem(sys.modules, module.__name__, module)
    undo = tune.Undo([module.__name__])
    exec("import fake_backend_settings as s; s.CHUNK = 8192", {})
    assert module.CHUNK == 8192 and undo.added() == []
    exec("import fake_backend_settings as s; s.CHUNKS = 8192", {})
    assert undo.added() == ["fake_backend_settings.CHUNKS"]
    undo.restore()
    assert module.CHUNK == 4096 and not hasattr(module, "CHUNKS") and undo.added() == []


def test_tune_scripts_set_only_settings_that_exist(monkeypatch):
    """Every `alias.SETTING = ...` in benchmarks/tune/*.sh names a constant of the module imported as
    `alias` (a renamed constant would leave its variant timing the defaults; tune.py now stops there too)."""
    import importlib
    import re
    import types

    if importlib.util.find_spec("cupy") is None:  # the CuPy modules import cupy but need it only to launch
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.syspath_prepend(str(ROOT / "backends"))
    checked = 0
    for script in sorted((ROOT / "benchmarks" / "tune").glob("*.sh")):
        text = script.read_text()
        # "import a as x" and "import a as x, b as y"
        aliases = {alias: module for module, alias in re.findall(r"\b(multisoft_[\w.]+) as (\w+)", text)}
        for alias, name in sorted(set(re.findall(r"\b(\w+)\.([A-Z][A-Z0-9_]*) =", text))):
            assert alias in aliases, f"{script.name}: {alias}.{name} without an import of {alias}"
            assert hasattr(importlib.import_module(aliases[alias]), name), f"{script.name}: {aliases[alias]}.{name}"
            checked += 1
    assert checked > 30
