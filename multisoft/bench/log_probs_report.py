"""results.md's per-token log-probabilities sections: on logits (``log_probs``), one table per case (shape and
dtype), fractions of the copy bandwidth at the op's floors; fused with the output layer (``linear_log_probs``), one
table per case, multiples of the four matrix products. Each multisoft backend against its targets."""

from __future__ import annotations

from .cells import as_shown
from .impls import LIGER_PEER
from .linear_report import TIME_TARGET, verdict
from .log_probs import FLOOR_PASSES, TEMPERATURE
from .plan import DEFAULT_TARGET, TARGETS, target_of
from .records import LinearLogProbsRecord, LogProbsRecord

ENTROPY_TARGET = 0.05  # what the entropy may add to a backend's forward+backward (kernel time), less than this


def speed_target(impl: str) -> float | None:
    """A backend's fraction-of-copy target: the one the main tables hold it to (plan.target_of: 0.90, numba
    0.80, none for the torch backend)."""
    return target_of(impl)


def speed_targets_text() -> str:
    """The speed targets as results.md states them: "0.90 (numba 0.80; none for the torch backend)"."""
    others = [f"{name} {target:.2f}" for name, target in TARGETS.items() if target is not None]
    others += [f"none for the {name} backend" for name, target in TARGETS.items() if target is None]
    return f"{DEFAULT_TARGET:.2f}" + (f" ({'; '.join(others)})" if others else "")


def _number(value, style: str) -> str:
    """``value`` formatted by ``style`` ("%": a signed percent, one decimal); "—" for None."""
    if value is None:
        return "—"
    return f"{value * 100:+.1f} %" if style == "%" else format(value, style)


def _pair(kernel, eager, style: str) -> str:
    """A kernel / eager cell; "—" where neither was measured."""
    if kernel is None and eager is None:
        return "—"
    return f"{_number(kernel, style)} / {_number(eager, style)}"


def shown_percent(value: float) -> float:
    """A fraction as the table shows it in percent, one decimal."""
    return float(f"{value * 100:.1f}")


def target_misses(record: LogProbsRecord, case: list[LogProbsRecord]) -> list[str]:
    """The targets a backend's ``record`` misses among the records of its ``case`` ([]: all met), on the kernel
    time: forward+backward and forward each at least its speed_target of the copy bandwidth at their floors (as the
    table shows them, two decimals; none for a backend without one), the entropy adding less than ENTROPY_TARGET
    to forward+backward (as shown, one decimal of a percent), forward+backward faster than every peer timed."""
    if record.ms is None:
        return ["not timed"]
    misses = []
    target = speed_target(record.impl)
    if target is not None:
        for direction, value in (("forward+backward", record.fraction_of_copy), ("forward", record.forward_fraction)):
            if value is None or as_shown(value) < target:
                shown = "no fraction of copy" if value is None else f"{value:.2f} of copy"
                misses.append(f"{direction}: {shown} < {target:.2f}")
    cost = record.entropy_cost
    if cost is None or shown_percent(cost) >= ENTROPY_TARGET * 100:
        misses.append("entropy: not timed" if cost is None else
                      f"entropy: {_number(cost, '%')} ≥ +{ENTROPY_TARGET * 100:.0f} %")
    slower_than = [peer.impl for peer in case if peer.role == "peer" and peer.ms is not None and peer.ms <= record.ms]
    if slower_than:
        misses.append(f"not faster than {', '.join(slower_than)}")
    return misses


def _verdict(record: LogProbsRecord, case: list[LogProbsRecord]) -> str:
    if record.role != "backend":
        return record.note
    misses = target_misses(record, case)
    outcome = "met" if not misses else "missed: " + "; ".join(misses)
    if record.ms is not None and record.extra_gib is None:
        outcome += " (memory not measured)"
    return "; ".join(text for text in (record.note, outcome) if text)


def log_probs_table(case: list[LogProbsRecord]) -> list[str]:
    """One case's table: its heading, the copy of the logits' bytes as a line, a row per implementation."""
    first = case[0]
    copy = next((r for r in case if r.role == "copy"), None)
    lines = [f"### {first.shape} {first.dtype}", "",
             f"Logits {first.logits_gib:.2f} GiB: forward's floor reads them once, forward+backward's three times."]
    if copy is not None:
        reach = (f"reaches {_pair(copy.fraction_of_copy, copy.eager_fraction, '.2f')} of the copy bandwidth "
                 f"({_pair(copy.ms, copy.eager_ms, '.3f')} ms)" if copy.ms is not None else copy.note)
        lines[-1] += f" A copy of the logits (`dst.copy_(src)`, their bytes read and written) {reach}."
    lines += ["",
              "| impl | fwd+bwd ms | fwd+bwd of copy | fwd ms | fwd of copy | entropy adds | extra GiB "
              "| beyond gradient GiB | log_probs error | entropy error | gradient error | targets, note |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in case:
        if r.role == "copy":
            continue
        lines.append(f"| {r.impl} | {_pair(r.ms, r.eager_ms, '.3f')} | "
                     f"{_pair(r.fraction_of_copy, r.eager_fraction, '.2f')} | "
                     f"{_pair(r.forward_ms, r.forward_eager_ms, '.3f')} | "
                     f"{_pair(r.forward_fraction, r.forward_eager_fraction, '.2f')} | "
                     f"{_pair(r.entropy_cost, r.eager_entropy_cost, '%')} | "
                     f"{_number(r.extra_gib, '.2f')} | {_number(r.beyond_gradient_gib, '.2f')} | "
                     f"{_number(r.log_probs_error, '.1e')} | {_number(r.entropy_error, '.1e')} | "
                     f"{_number(r.grad_error, '.1e')} | {_verdict(r, case)} |")
    return lines + [""]


def _by_case(records: list) -> list[list]:
    cases: dict[tuple, list] = {}
    for record in records:
        cases.setdefault((record.shape, record.dtype), []).append(record)
    return list(cases.values())


def log_probs_section(records: list[LogProbsRecord]) -> list[str]:
    """The section of ``--ops log_probs``: what is measured and the targets, then each case's table in run
    order."""
    if not records:
        return []
    lines = ["## Per-token log-probabilities and entropy",
             "",
             "The forward+backward of a reinforcement-learning per-token objective on logits x (M x V; shapes "
             "M x V), `(log_probs * g).sum() + (entropy * c).sum()` with random per-token g and c (float32) and "
             f"random targets, `return_entropy=True`, temperature {TEMPERATURE:g}: `x.grad = None`, the forward and "
             "`backward()`, eager, a new graph each call. Each multisoft backend: `multisoft.log_probs(x, target, "
             f"temperature={TEMPERATURE:g}, return_entropy=True, backend=b)`; `torch-native`: torch's unfused way, "
             f"`lp = torch.log_softmax(x.float() / {TEMPERATURE:g}, -1)`, `lp.gather(-1, target[:, None])`, the "
             "entropy `-(lp.exp() * lp).sum(-1)`. Times: **kernel / eager** in ms, kernel as `timing` says (the "
             "host hidden by default), eager as `eager timing` says (L2 flushed, the host not hidden); fwd: the "
             "forward alone, of logits that do not require grad. Of copy: the bandwidth at the op's floor as a "
             "fraction of the copy bandwidth above, the floor of fwd+bwd "
             f"{FLOOR_PASSES['forward+backward']} passes over the logits (M·V × element size each: the forward "
             "reads them, the backward reads them again and writes their gradient), of fwd "
             f"{FLOOR_PASSES['forward']} (one read). Entropy adds: fwd+bwd over the same without the entropy "
             "(`return_entropy=False`, `(log_probs * g).sum()`), less 1, kernel / eager. Extra: the peak memory "
             "allocated during one fwd+bwd beyond what was allocated before it (the logits, targets, g and c), "
             "the logits' gradient included; beyond gradient: that less the gradient's bytes (the logits'). "
             "Errors: max |value − float64 reference| / max |reference| over every row "
             "(`multisoft.check.reference_log_probs` and `reference_log_probs_gradient`, a chunk of rows at a "
             "time). Each multisoft backend's targets, on the kernel time, as shown: fwd+bwd and fwd each at least "
             f"the main tables' fraction of copy, {speed_targets_text()}; the entropy adding less than "
             f"{ENTROPY_TARGET * 100:.0f} %; fwd+bwd faster than every peer. "
             "Liger-Kernel has no differentiable per-token log-probability of logits (its fused op takes the "
             "hidden states: `linear_log_probs`). `log_probs.csv` has every number.",
             ""]
    for case in _by_case(records):
        lines += log_probs_table(case)
    return lines


def linear_log_probs_table(case: list[LinearLogProbsRecord]) -> list[str]:
    """One case's table: a row per implementation (the products first), and its heading."""
    first = case[0]
    lines = [f"### {first.shape} {first.dtype}", "",
             f"Logits {first.logits_gib:.2f} GiB, the two gradients {first.gradients_gib:.2f} GiB.", "",
             "| impl | ms | × products | extra GiB | beyond gradients GiB | × logits | log_probs error "
             "| entropy error | input.grad error | weight.grad error | targets, note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in case:
        lines.append(f"| {r.impl} | {_number(r.ms, '.2f')} | {_number(r.of_products, '.2f')} | "
                     f"{_number(r.extra_gib, '.2f')} | {_number(r.beyond_gradients_gib, '.2f')} | "
                     f"{_number(r.of_logits, '.3f')} | {_number(r.log_probs_error, '.1e')} | "
                     f"{_number(r.entropy_error, '.1e')} | {_number(r.grad_input_error, '.1e')} | "
                     f"{_number(r.grad_weight_error, '.1e')} | {verdict(r, case)} |")
    return lines + [""]


def linear_log_probs_section(records: list[LinearLogProbsRecord], liger_note: str | None = None) -> list[str]:
    """The section of ``--ops linear_log_probs``: what is measured and the targets, then each case's table in run
    order."""
    if not records:
        return []
    liger = f" (here: {liger_note})" if liger_note else ""
    lines = ["## Fused linear per-token log-probabilities",
             "",
             "The forward+backward of the per-token objective of the section above of the logits `x @ w.T` (x: "
             "M x H hidden states, w: V x H, no bias; shapes M x H x V), both requiring grad: `.grad = None`, "
             "then `(log_probs * g).sum() + (entropy * c).sum()` and `backward()`, eager, timed as "
             "`linear_log_probs timing` says (L2 cleared before each call, host included). `products`: the four "
             "matrix products alone, the floor of a fused op that keeps no logits (g and c are not known in the "
             "forward, so the backward computes the logits again): `x @ w.T` into a preallocated l, the same "
             "again, `l @ w` and `l.T @ x`. Each multisoft backend: `multisoft.linear_log_probs(x, w, target, "
             f"temperature={TEMPERATURE:g}, return_entropy=True, backend=b)`; `torch-native`: the section above's "
             "unfused way on `F.linear(x, w)` (upcast to float32); `liger`: Liger-Kernel's "
             f"`LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, target, {TEMPERATURE:g}, -100, 1, True)`, "
             f"its log-probabilities the negative of the negative log-likelihood it returns{liger}. Extra: the "
             "peak memory allocated during one step beyond what was allocated before it (the inputs), the two "
             "gradients included; beyond gradients: that less the gradients' bytes, and as a fraction of the "
             "logits' size (M·V × element size). Errors: max |value − float64 reference| / max |reference| of "
             "the log-probabilities, the entropy, x's gradient and w's gradient, over every row (each chunk's "
             "logits as `F.linear` rounds them, the rest in float64). Each multisoft backend's targets, those of "
             f"fused linear cross-entropy: time ≤ {TIME_TARGET:.2f}× the products, memory beyond the gradients "
             f"≤ 1/8 of the logits and ≤ that of {LIGER_PEER} (where timed), faster than every peer. "
             "`linear_log_probs.csv` has every number.",
             ""]
    for case in _by_case(records):
        lines += linear_log_probs_table(case)
    return lines
