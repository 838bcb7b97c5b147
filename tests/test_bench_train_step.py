"""The benchmark's training step of a small Llama (``--ops train_step``): its model, one step of each loss against
float64 PyTorch, a run of eager variants on the CPU with the torch backend, and its CSV and section of results.md.
torch.compile is left to the GPU run (compiling on the CPU takes tens of seconds)."""

import argparse
import csv
import math

import pytest
import torch
import torch.nn.functional as F

from multisoft import bench
from multisoft.bench import command, plan, records, report, run, train_step, train_step_report
from multisoft.bench.progress import Progress

TINY = train_step.ModelConfig(vocab=300, hidden=32, layers=2, heads=2, intermediate=48, batch=2, sequence=16)
TINY_COUNTS = train_step.StepCounts(warmup=2, timed=2, repeats=2)
GRADIENT_TOLERANCE = 1e-5  # max |grad - float64| / max |float64| of each parameter: float32 through 2 blocks
LOSS_TOLERANCE = 1e-6  # relative, of the loss


def test_the_op_is_asked_for_by_name_only(capsys):
    assert command.parse_args(["--ops", "step"]).ops == ["train_step"]
    assert command.parse_args(["--ops", "softmax,train_step"]).ops == ["softmax", "train_step"]
    assert "train_step" not in command.parse_args([]).ops
    assert plan.plan_cases(["train_step"], quick=False) == {}
    assert bench.main(["--ops", "train_step,steps"]) == 2
    assert "unknown op 'steps'" in capsys.readouterr().err


def test_the_configs():
    default = train_step.config(quick=False)
    assert (default.vocab, default.hidden, default.layers, default.heads, default.intermediate, default.batch,
            default.sequence, default.dtype) == (32000, 256, 4, 4, 688, 8, 256, "fp32")
    assert default.label == "vocab 32000, hidden 256, 4 layers, 4 heads, MLP 688, batch 8x256, fp32"
    quick = train_step.config(quick=True)
    assert (quick.vocab, quick.hidden, quick.layers, quick.batch, quick.sequence) == (512, 64, 2, 2, 32)
    assert train_step.counts(quick=False) == train_step.StepCounts(5, 25, 5)
    assert train_step.counts(quick=True).timed < train_step.counts(quick=False).timed


@pytest.mark.parametrize("changes, named", [
    (dict(heads=3), "hidden"), (dict(heads=32, hidden=32), "hidden"), (dict(vocab=0), "vocab"),
    (dict(layers=1.5), "layers"), (dict(sequence=1), "sequence"), (dict(dtype="int8"), "dtype")])
def test_a_bad_config_names_its_argument(changes, named):
    with pytest.raises(ValueError, match=f"^{named} must"):
        train_step.ModelConfig(**{**dict(vocab=300, hidden=32, heads=2), **changes})


def test_bad_step_counts_modes_and_losses_are_refused():
    with pytest.raises(ValueError, match="warmup must be >= 2"):
        train_step.StepCounts(warmup=1)
    with pytest.raises(ValueError, match="^modes must be of eager, compiled, reduce-overhead, got 'graphs'"):
        train_step.variants(["torch"], ("eager", "graphs"))
    with pytest.raises(ValueError, match="^loss must be one of torch, multisoft, multisoft-fused, got 'mse'"):
        train_step.make_loss("mse")
    model = train_step.make_model(TINY, "cpu")
    with pytest.raises(ValueError, match="^mode must be one of"):
        train_step.make_step(model, train_step.make_loss("torch"), train_step.make_optimizer(model), "jit")


def test_the_variants():
    """Eager: the torch loss and multisoft's two losses on every backend; each compiled mode: the torch loss and
    the first backend's two."""
    found = [(v.mode, v.loss, v.backend) for v in train_step.variants(["triton", "cupy"])]
    ours = [("multisoft", "triton"), ("multisoft-fused", "triton")]
    assert found == ([("eager", "torch", "")] + [("eager", *each) for each in ours]
                     + [("eager", "multisoft", "cupy"), ("eager", "multisoft-fused", "cupy")]
                     + [("compiled", "torch", "")] + [("compiled", *each) for each in ours]
                     + [("reduce-overhead", "torch", "")] + [("reduce-overhead", *each) for each in ours])
    assert [(v.mode, v.loss) for v in train_step.variants([], ("compiled",))] == [("compiled", "torch")]


def test_the_model():
    """The final hidden states (B, T, hidden) of the config's dtype; an untied lm_head without bias; the same
    weights from the same seed; causal: a token changes the hidden states at its position and after, not before."""
    model = train_step.make_model(TINY, "cpu")
    tokens = train_step.make_batches(TINY, "cpu")[0]
    assert train_step.make_batches(TINY, "cpu").shape == (train_step.BATCHES, TINY.batch, TINY.sequence)
    hidden = model(tokens)
    assert hidden.shape == (TINY.batch, TINY.sequence, TINY.hidden) and hidden.dtype == torch.float32
    assert model.lm_head.weight.shape == (TINY.vocab, TINY.hidden) and model.lm_head.bias is None
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()
    assert len(model.blocks) == TINY.layers
    again = train_step.make_model(TINY, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % TINY.vocab
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert (before[:, 9:] - after[:, 9:]).abs().amax(-1).min() > 0


def test_the_rotary_embedding_depends_on_relative_positions_only():
    """q·k of rotated q at position m and k at n is that of positions m + 5 and n + 5, and not that of m + 5 and n."""
    head_size = TINY.hidden // TINY.heads
    inv_freq = TINY.rope_theta ** -(torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    cos, sin = train_step.rotary_tables(12, inv_freq, torch.float64)
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, head_size, generator=generator, dtype=torch.float64)

    def score(m, n):
        return (train_step.rotate(q, cos[m], sin[m]) * train_step.rotate(k, cos[n], sin[n])).sum().item()

    assert score(2, 1) == pytest.approx(score(7, 6), rel=1e-12)
    assert score(4, 0) == pytest.approx(score(9, 5), rel=1e-12)
    assert abs(score(7, 1) - score(2, 1)) > 1e-3


def _float64_reference(tokens):
    """The loss and the gradient of every parameter of the same model in float64, with F.cross_entropy."""
    model = train_step.make_model(TINY, "cpu").double()
    hidden = model(tokens)
    loss = F.cross_entropy(model.lm_head(hidden[:, :-1]).reshape(-1, TINY.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("loss_name", train_step.LOSSES)
def test_one_step_of_each_loss_agrees_with_float64(loss_name):
    """One step of the torch loss and of multisoft's two on its torch backend (the CPU): the loss and the gradient
    of every parameter are float64 PyTorch's to float32's rounding, and AdamW has moved every parameter."""
    tokens = train_step.make_batches(TINY, "cpu")[0]
    expected_loss, expected_grads = _float64_reference(tokens)
    model = train_step.make_model(TINY, "cpu")
    step = train_step.make_step(model, train_step.make_loss(loss_name, "torch"), train_step.make_optimizer(model))
    loss = step(tokens)
    assert loss.dtype == torch.float32 and not loss.requires_grad
    assert loss.item() == pytest.approx(expected_loss, rel=LOSS_TOLERANCE)
    assert expected_loss == pytest.approx(math.log(TINY.vocab), rel=0.01)  # small weights: about uniform
    initial = dict(train_step.make_model(TINY, "cpu").named_parameters())
    for name, parameter in model.named_parameters():
        expected = expected_grads[name]
        error = (parameter.grad.double() - expected).abs().max() / expected.abs().max()
        assert error <= GRADIENT_TOLERANCE, (loss_name, name, error.item())
        assert not torch.equal(parameter, initial[name]), name


def _cpu_runner(monkeypatch):
    monkeypatch.setattr(run, "DEVICE", "cpu")
    runner = run.Runner(argparse.Namespace(warmup=1.0, rep=1.0, timer="do_bench", eager_rep=1.0, headline=False))
    runner.progress = Progress(100)
    return runner


def test_a_cpu_run_of_the_eager_variants(monkeypatch):
    """The torch backend, a backend that does not exist and a fused loss that raises: a record per variant in
    order; the ones that run train the same (the same final loss, below the untrained model's) and are compared
    with the torch loss; the failing ones say why and the run goes on."""
    real_make_loss = train_step.make_loss

    def make_loss(name, backend=""):
        if name == "multisoft-fused" and backend == "torch":
            raise RuntimeError("boom")
        return real_make_loss(name, backend)

    monkeypatch.setattr(train_step, "make_loss", make_loss)
    runner = _cpu_runner(monkeypatch)
    try:
        found = train_step.run_cases(runner, train_step.variants(["torch", "nope"], ("eager",)), TINY, TINY_COUNTS)
    finally:
        runner.progress.close()
    assert [(r.mode, r.loss, r.backend, r.model) for r in found] == [
        ("eager", "torch", "", TINY.label), ("eager", "multisoft", "torch", TINY.label),
        ("eager", "multisoft-fused", "torch", TINY.label), ("eager", "multisoft", "nope", TINY.label),
        ("eager", "multisoft-fused", "nope", TINY.label)]
    torch_loss, ours, boom = found[:3]
    for record in (torch_loss, ours):
        assert record.note == "" and record.tokens_per_s > 0 and record.first_step_s > 0
        assert record.peak_gib is None  # off a GPU
    assert torch_loss.of_torch == 1.0 and torch_loss.loss_vs_torch == 0.0
    assert ours.of_torch == pytest.approx(ours.tokens_per_s / torch_loss.tokens_per_s)
    assert ours.loss_vs_torch <= train_step_report.LOSS_AGREEMENT
    steps = TINY_COUNTS.warmup + TINY_COUNTS.repeats * TINY_COUNTS.timed
    last_batch = train_step.make_batches(TINY, "cpu")[(steps - 1) % train_step.BATCHES]
    untrained_loss, _ = _float64_reference(last_batch)
    assert torch_loss.final_loss < untrained_loss - 0.01
    assert boom.note == "error: RuntimeError: boom" and boom.tokens_per_s is None and boom.of_torch is None
    for record in found[3:]:
        assert record.note.startswith("error: ValueError: unknown backend 'nope'") and record.tokens_per_s is None


def _record(mode, loss, backend, tokens_per_s, of_torch=None, loss_vs_torch=None, note="", peak=1.5):
    return records.TrainStepRecord(mode, loss, backend, "vocab 32000, hidden 256, 4 layers", tokens_per_s, of_torch,
                                   peak if tokens_per_s else None, 0.5 if tokens_per_s else None,
                                   None if tokens_per_s is None else 10.25, loss_vs_torch, note)


def _fake_train_step():
    return [_record("eager", "torch", "", 400000.0, 1.0, 0.0),
            _record("eager", "multisoft", "triton", 380000.0, 0.95, 1e-6),
            _record("compiled", "torch", "", 500000.0, 1.0, 0.0),
            _record("compiled", "multisoft", "triton", 510000.0, 1.02, 2e-6),       # met
            _record("compiled", "multisoft-fused", "triton", 435000.0, 0.87, 3e-3),  # slow, and trained otherwise
            _record("reduce-overhead", "multisoft", "triton", 498000.0, 0.996, 0.0),  # 1.00 as shown: met
            _record("reduce-overhead", "multisoft-fused", "triton", None, note="error: RuntimeError: boom")]


def test_the_verdicts():
    found = _fake_train_step()
    assert [train_step_report.verdict(r) for r in found] == [
        "", "", "", "met", "missed: 0.87× < 1.00×; final loss off the torch loss's by 3.0e-03 > 1e-03", "met",
        "error: RuntimeError: boom; missed: not timed"]
    alone = _record("compiled", "multisoft", "triton", 500000.0)
    assert train_step_report.verdict(alone) == "missed: no torch loss to compare with"


def test_the_section_and_its_csv(tmp_path):
    results = records.Results({"gpu": "Fake GPU"}, 4000.0, [records.Timing(
        "copy", "torch", "copy", "-", "copy", "1024 MiB", 0, "copy", 0.5, 2 << 30, 4000.0, 1.0)])
    results.train_step = _fake_train_step()
    text = report.markdown_report(results)
    section = text[text.index("## Training step of a small Llama"):]
    assert "(vocab 32000, hidden 256, 4 layers; `train_step model`)" in section
    assert "a compiled step with multisoft ≥ 1.00× the torch loss's tokens/s" in section
    assert "| eager | torch | — | 400000 | 1.00 | 1.50 | 0.5 | 10.2500 | 0.0e+00 |  |" in section
    assert "| compiled | multisoft | triton | 510000 | 1.02 | 1.50 | 0.5 | 10.2500 | 2.0e-06 | met |" in section
    assert "| compiled | multisoft-fused | triton | 435000 | 0.87 | 1.50 | 0.5 | 10.2500 | 3.0e-03 | missed: 0.87× " \
           "< 1.00×; final loss off" in section
    assert "| reduce-overhead | multisoft-fused | triton | — | — | — | — | — | — | error: RuntimeError: boom; " \
           "missed: not timed |" in section
    out = tmp_path / "out"
    paths = report.write_reports(results, out)
    assert out / records.TRAIN_STEP_FILE in paths
    with open(out / records.TRAIN_STEP_FILE, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["mode"], row["loss"], row["backend"]) for row in rows] == [
        (r.mode, r.loss, r.backend) for r in results.train_step]
    assert rows[6]["tokens_per_s"] == "" and rows[6]["note"] == "error: RuntimeError: boom"
    again = records.read_results(out)
    assert again.train_step == results.train_step
    assert report.markdown_report(again) == text
    # a run without the op: no section, no file
    results.train_step = []
    assert "Training step" not in report.markdown_report(results)
    assert records.TRAIN_STEP_FILE not in [p.name for p in report.write_reports(results, tmp_path / "other")]


def test_the_command_runs_the_op_alone(monkeypatch, tmp_path, capsys):
    """``--ops step --quick`` on the CPU, the GPU's parts stood in for (the copy, the environment), the quick
    model made tiny and the modes eager only: it writes train_step.csv and the section, and times nothing else."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "copy_ms", lambda timer: 1.0)
    monkeypatch.setattr(run, "environment", lambda backends, runner, liger_note: {"gpu": "a CPU"})
    monkeypatch.setattr(train_step, "QUICK_CONFIG", TINY)
    monkeypatch.setattr(train_step, "QUICK_COUNTS", TINY_COUNTS)
    monkeypatch.setattr(train_step, "MODES", {"eager": None})
    out = tmp_path / "out"
    assert command.main(["--ops", "step", "--quick", "--backends", "torch", "--no-plots", "--out", str(out)]) == 0
    assert f"wrote {out / records.TRAIN_STEP_FILE}" in capsys.readouterr().out
    saved = records.read_results(out)
    assert [(r.mode, r.loss, r.backend) for r in saved.train_step] == [
        ("eager", "torch", ""), ("eager", "multisoft", "torch"), ("eager", "multisoft-fused", "torch")]
    assert all(r.tokens_per_s > 0 and r.note == "" for r in saved.train_step)
    assert [t.role for t in saved.timings] == ["copy"] and saved.host_times == [] and saved.linear == []
    assert saved.environment["train_step model"].endswith(TINY.label)
    assert saved.environment["train_step timing"] == train_step.timing_note(TINY_COUNTS)
    assert "## Training step of a small Llama" in (out / "results.md").read_text()
