"""The command line as a user meets it: exit statuses, messages, pipes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import multisoft
from multisoft import cli
from multisoft._registry import ENV_VAR


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "multisoft", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_check_of_an_unknown_backend_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--backends", "foo"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown backend 'foo'" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where cupy cannot run: no CUDA device")
def test_check_of_a_backend_that_cannot_run_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--backends", "cupy"])
    assert exit_.value.code == 2
    assert "backend 'cupy' cannot run on cpu" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skipped backends are the ones a CPU cannot run")
def test_check_says_what_it_skipped_and_how_to_include_it():
    plain = {k: v for k, v in os.environ.items() if k not in cli.SIMULATION_VARIABLES}
    result = subprocess.run([sys.executable, "-m", "multisoft", "check"], capture_output=True, text=True, env=plain)
    assert result.returncode == 0, result.stdout + result.stderr
    import multisoft

    cannot = [b.name for b in multisoft.backends("cpu") if not b.available]
    if not cannot:
        pytest.skip("every installed backend runs here: nothing to skip")
    for name in cannot:
        assert f"skipped {name}: " in result.stdout
    assert "--simulate" in result.stdout


def test_the_help_names_the_program_as_it_was_called(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: multisoft ")
    assert _run("--help").stdout.startswith("usage: python -m multisoft ")


def test_info_into_a_closed_pipe_ends_quietly():
    process = subprocess.Popen([sys.executable, "-m", "multisoft", "info"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the program writes, as with `| head -0`
    _, err = process.communicate()
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()
    assert process.returncode == 0


# -- subcommands: their own usage, help and description


@pytest.mark.parametrize("argv, usage", [(["check", "--bogus"], "usage: multisoft check "),
                                         (["info", "--bogus"], "usage: multisoft info "),
                                         (["check", "--backends", "foo"], "usage: multisoft check ")])
def test_a_subcommands_error_prints_its_own_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"multisoft {argv[0]}: error: " in err and "{info,check,bench}" not in err


def _description(help_text: str) -> str:
    """The paragraph between a --help's usage and its options."""
    paragraphs = help_text.split("\n\n")
    return "" if paragraphs[1].startswith(("options:", "optional arguments:")) else paragraphs[1]


@pytest.mark.parametrize("command", ["info", "check", "bench"])
def test_each_subcommand_has_a_help_line_and_a_description(command, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listing = capsys.readouterr().out
    assert re.search(rf"^    {command} +\S", listing, re.M), listing   # its one line under the top level's help
    if command == "bench":  # bench answers --help itself (multisoft.bench.command) and returns its status
        assert cli.main([command, "--help"]) == 0
    else:
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: multisoft {command} ")
    assert len(_description(out).split()) >= 10, out


# -- info and $MULTISOFT_BACKEND


def test_info_flags_an_unknown_backend_in_the_environment_variable(monkeypatch, capsys):
    monkeypatch.setenv(ENV_VAR, "torch,foo")
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "INVALID environment variable MULTISOFT_BACKEND='torch,foo': unknown backend 'foo'; known backends: " in out
    assert "  torch " in out, "the backends are listed all the same"
    monkeypatch.setenv(ENV_VAR, "reference, torch")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "MULTISOFT_BACKEND='reference, torch'\n" in out and "INVALID" not in out


# -- check: linear_cross_entropy, and the simulation's warnings


def test_check_covers_linear_cross_entropy_forward_and_every_gradient(monkeypatch, capsys):
    """Its loss, lse and the gradients of input, weight and bias against float64; a wrong weight gradient
    (scaled by 1.1 through a hook) fails those rows, and only those, with exit status 1."""
    parts = ("forward", "lse", "backward input", "backward weight", "backward bias")
    assert cli.main(["check", "--backends", "torch"]) == 0
    out = capsys.readouterr().out
    for part in parts:
        rows = re.findall(rf"^linear_cross_entropy {part} +\|.*\| (\w+) *$", out, re.M)
        assert rows == ["pass"] * 3, (part, rows)   # one shape, three dtypes

    real = multisoft.linear_cross_entropy

    def wrong_weight_gradient(input, linear_weight, *args, **kwargs):
        linear_weight.register_hook(lambda grad: grad * 1.1)
        return real(input, linear_weight, *args, **kwargs)

    monkeypatch.setattr(multisoft, "linear_cross_entropy", wrong_weight_gradient)
    assert cli.main(["check", "--backends", "torch"]) == 1
    out = capsys.readouterr().out
    failed = re.findall(r"^(\S+ [\w ]+?) +\|.*\| FAIL *$", out, re.M)
    assert failed == ["linear_cross_entropy backward weight"] * 3, failed


def _numpy_warnings_from(module: str):
    """Warnings that numpy raises, as it does in Triton's interpreter or a simulated numba kernel, in a function of
    the module called ``module``."""
    source = ("def run():\n"
              "    minus_inf = np.array([-np.inf], dtype=np.float32)\n"
              "    np.subtract(minus_inf, minus_inf)\n"                  # invalid value encountered in subtract
              "    np.log(np.zeros(1, dtype=np.float32))\n"              # divide by zero encountered in log
              "    np.exp(np.full(1, 1000.0, dtype=np.float32))\n")      # overflow encountered in exp
    namespace = {"__name__": module, "np": __import__("numpy")}
    exec(compile(source, f"<{module}>", "exec"), namespace)
    return namespace["run"]


def test_check_silences_the_simulations_known_warnings_and_no_others(monkeypatch, capsys):
    """NaN and division by zero in the interpreter and in simulated numba kernels (discarded lanes): silenced;
    overflow there, or the same warnings from any other module, still shown."""
    import warnings

    import multisoft.check

    def run_check(device, names, small):
        for module in ("triton.runtime.interpreter", "multisoft_numba._softmax_rows", "somebody_else"):
            _numpy_warnings_from(module)()
        warnings.warn("invalid value encountered in subtract", UserWarning)
        return []

    monkeypatch.setattr(multisoft.check, "run_check", run_check)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert cli.main(["check", "--backends", "torch"]) == 0
    seen = sorted((w.category.__name__, str(w.message).split(" encountered")[0]) for w in shown)
    assert seen == sorted([("RuntimeWarning", "overflow")] * 2 + [
        ("RuntimeWarning", "invalid value"), ("RuntimeWarning", "divide by zero"), ("RuntimeWarning", "overflow"),
        ("UserWarning", "invalid value")]), seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_check_simulate_prints_no_interpreter_warning():
    result = _run("check", "--simulate", "--backends", "triton")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed, 0 failed" in result.stdout
    assert "Warning" not in result.stderr, result.stderr
