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
from multisoft.bench import command, impls, plan, records, report, run, timing

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


def test_arguments():
    args = command.parse_args(["--ops", "blocksparse, ce,softmax", "--dtypes", "bf16", "--fp16", "--quick"])
    assert args.ops == ["blocksparse_softmax", "cross_entropy", "softmax"]
    assert args.dtypes == ["bf16", "fp16"]
    assert args.timer == "queued"
    args = command.parse_args(["--backends", "triton,torch", "--timer", "do_bench"])
    assert args.timer == "do_bench"
    assert args.ops == list(plan.OPS) and args.dtypes == ["fp32", "bf16"] and args.backends == ["triton", "torch"]
    assert (args.warmup, args.rep) == (5.0, 25.0)
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
    ("softmax", (2, 3, 5)), ("log_softmax", (2, 3, 5)), ("blocksparse_softmax", (2, 3, 5)),
    ("cross_entropy", (1, 2, 3)),
])
def test_bytes_moved(op, factors):
    for direction, factor in zip(plan.DIRECTIONS, factors):
        assert plan.bytes_moved(op, direction, 1000, 2) == factor * 1000 * 2
    assert plan.bytes_moved(op, "forward", 16384 * 4096, 4) == factors[0] * 16384 * 4096 * 4


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


def test_quick_plan_is_small():
    cases = plan.plan_cases(list(plan.OPS), quick=True)
    assert set(cases) == set(plan.OPS)
    assert sum(len(op_cases) for op_cases in cases.values()) <= 16


def _timing(op, impl, dtype, shape, direction, fraction, role="backend", group="headline", n=0, note=""):
    copy = 4000.0
    gbps = None if fraction is None else fraction * copy
    elements = 1 << 26
    nbytes = plan.bytes_moved(op, direction, elements, plan.ELEMENT_SIZE[dtype])
    ms = None if gbps is None else nbytes / (gbps * 1e6)
    return records.Timing(op, impl, role, dtype, group, shape, n, direction, ms, nbytes, gbps, fraction, note)


def _fake_results():
    timings = [records.Timing("copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)]
    for direction in plan.DIRECTIONS:
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
    results = records.Results({"gpu": "Fake GPU", "timing": "fake"}, 4000.0, timings)
    results.memory = [records.MemoryRecord("triton", "fp32", "8192x32000", 1000.0, 1000.0),
                      records.MemoryRecord("triton inplace", "fp32", "8192x32000", 0.5, 1000.0),
                      records.MemoryRecord("numba", "fp32", "8192x32000", None, 1000.0, "error: ImportError: x")]
    results.first_calls = [records.FirstCall("triton", "softmax", "forward", "bf16", "16384x4096", 812.5, 0.07)]
    results.overhead = [records.Overhead("triton", 21.0, 6.5), records.Overhead("cupy", None, None, "error: x")]
    return results


def test_reports(tmp_path):
    results = _fake_results()
    paths = report.write_reports(results, tmp_path / "out")
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
    assert again.memory[2].peak_mib is None and again.memory[1].peak_mib == 0.5
    assert again.first_calls == results.first_calls and again.overhead == results.overhead
    assert report.markdown_report(again) == report.markdown_report(results)


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

    for name, value in {"COPY_BYTES": 1 << 20, "QUICK_HEADLINE": [(8, 64)],
                        "QUICK_SWEEP_COLS": [32, 64, 128], "SWEEP_ELEMENTS": 512,
                        "QUICK_CROSS_ENTROPY": [(8, 100)], "QUICK_LAYOUTS": [(16, 0.5, False), (16, 0.5, True)],
                        "HEADS": 2, "SEQ": 64}.items():
        monkeypatch.setattr(plan, name, value)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "make_timer", lambda warmup, rep, kind: (_wall_ms, "wall clock (test)"))
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
    assert "- commit: " in text
