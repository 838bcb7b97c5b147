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
