"""results.md: the environment, the headline summary, the cells below each backend's speed target with why, one
table per op and direction (fractions of the copy bandwidth, kernel / eager), fused linear cross-entropy,
vocabulary-parallel cross-entropy, a small Llama's training step, per-token log-probabilities (on logits, and
fused with the output layer), then peak memory, first calls, copies of each shape's bytes and the host time a
call."""

from __future__ import annotations

import collections
from pathlib import Path

from . import plan
from .plan import target_of
from .cells import as_shown, fraction_cell, impl_order, number
from .headline import headline_section, host_time_section
from .linear_report import linear_section
from .log_probs_report import linear_log_probs_section, log_probs_section
from .records import (BYTES_COUNTED, COPY_AT_END, LIGER_LOG_PROBS, Results, Shortfall, Timing, first_shortfall,
                      write_records)
from .train_step_report import train_step_section
from .vocab_parallel_report import vocab_parallel_section

# The backends' speed targets (plan.TARGETS, plan.DEFAULT_TARGET) hold over the directions of each op that
# TARGET_DIRECTIONS names, on the headline shapes, the cross-entropy shapes and the block-sparse layouts.
TARGET_DIRECTIONS = {"softmax": ("forward", "backward"), "log_softmax": ("forward", "backward"),
                     "cross_entropy": ("forward+backward",), "blocksparse_softmax": ("forward", "backward")}
NO_REASON = "no reason on record"
# How the bytes of a run that did not record them (no BYTES_COUNTED entry) were counted: cross-entropy's backward
# as a pass of its own that read the logits again and wrote the gradient.
BYTES_COUNTED_UNRECORDED = ("softmax, log_softmax and block-sparse (over Z·nnz·block² elements): forward 2, backward "
                            "3, forward+backward 5 × elements × element size; cross-entropy: 1, 2, 3 × M·V × element "
                            "size. A fused implementation can pass 1.0 on forward+backward")


def write_markdown(results: Results, out: Path, shortfalls: list[Shortfall] | None = None) -> Path:
    markdown = out / "results.md"
    markdown.write_text(markdown_report(results, shortfalls))
    return markdown


def write_reports(results: Results, out: Path, shortfalls: list[Shortfall] | None = None) -> list[Path]:
    """The records (CSV, environment.json) and results.md in ``out``; the paths written."""
    return write_records(results, out) + [write_markdown(results, out, shortfalls)]


def fraction_table(timings: list[Timing], direction: str) -> list[str]:
    """Markdown rows: one per (shape, dtype), one column per impl, cells the fraction of copy (kernel / eager
    where any cell has an eager time)."""
    rows = [t for t in timings if t.direction == direction]
    if not rows:
        return []
    impls = impl_order(rows)
    eager = any(t.eager_ms is not None for t in rows)
    keys = list(dict.fromkeys((t.shape, t.dtype) for t in rows))
    by_key = {(t.shape, t.dtype, t.impl): t for t in rows}
    lines = ["| shape | dtype | " + " | ".join(impls) + " |", "|---|---|" + "---:|" * len(impls)]
    for shape, dtype in keys:
        cells = [by_key.get((shape, dtype, impl)) for impl in impls]
        fractions = [c.fraction_of_copy for c in cells if c is not None and c.fraction_of_copy is not None]
        best = max(fractions) if len(fractions) > 1 else None
        lines.append(f"| {shape} | {dtype} | " + " | ".join(fraction_cell(c, best, eager) for c in cells) + " |")
    return lines


def _op_section(op: str, timings: list[Timing]) -> list[str]:
    lines = [f"## {op}", ""]
    main = [t for t in timings if t.group != "sweep"]
    dtypes = list(dict.fromkeys(t.dtype for t in timings))
    sweep = sorted((t for t in timings if "sweep" in t.group), key=lambda t: (dtypes.index(t.dtype), t.n))
    for direction in ("forward+backward", "forward", "backward"):
        table = fraction_table(main, direction)
        if table:
            lines += [f"**{direction}**", ""] + table + [""]
    if sweep:
        lines += [f"<details><summary>sweep over N (M·N = {plan.SWEEP_ELEMENTS >> 20}M elements)</summary>", ""]
        for direction in ("forward+backward", "forward", "backward"):
            table = fraction_table(sweep, direction)
            if table:
                lines += [f"**{direction}**", ""] + table + [""]
        lines += ["</details>", ""]
    if any(t.group == plan.OPTIONS_GROUP for t in timings):
        lines += [options_note(), ""]
    problems = _problems(timings)
    if problems:
        lines += ["Errors (`error`) and cells not timed (`—`):", ""] + problems + [""]
    return lines


def options_note() -> str:
    """What the rows labelled with plan.CROSS_ENTROPY_OPTIONS_LABEL time, for results.md."""
    softcap, scale = plan.CROSS_ENTROPY_OPTIONS["softcap"], plan.CROSS_ENTROPY_OPTIONS["lse_square_scale"]
    return (f"Rows labelled `{plan.CROSS_ENTROPY_OPTIONS_LABEL}`: the loss with Gemma 2's logit softcap and PaLM's "
            f"z-loss, `multisoft.cross_entropy(x, target, softcap={softcap:g}, lse_square_scale={scale:g})`, bytes "
            "counted at the same two-pass floor, not held to the targets. `torch-native` there is the torch ops a "
            f"user without multisoft writes: `F.cross_entropy(u, target) + {scale:g} * (torch.logsumexp(u, -1) ** "
            f"2).mean()` with `u = {softcap:g} * torch.tanh(x / {softcap:g})`; `liger`: `LigerCrossEntropyFunction` "
            "given its `softcap` and `lse_square_scale`. An implementation that lacks an option is not timed there "
            "(`—`, with the reason under the tables).")


def _problems(timings: list[Timing]) -> list[str]:
    """One line per (impl, note): the note, its first cell and how many more share it; errors first."""
    cells: dict[tuple, list[str]] = {}
    for t in timings:
        if t.note:
            cells.setdefault((t.impl, t.note), []).append(f"{t.dtype} {t.shape} {t.direction}")
    ordered = sorted(cells.items(), key=lambda item: not item[0][1].startswith("error"))
    return [f"- {impl}: {note} ({where[0]}{f' and {len(where) - 1} more' if len(where) > 1 else ''})"
            for (impl, note), where in ordered]


def _shortfall_note(timing: Timing, target: float, copy_bound: float | None,
                    shortfalls: list[Shortfall] | None) -> str:
    """A below-target cell's note: the run's own (an error), a copy of its bytes that stays under the target
    too, and the first matching shortfall's reason (NO_REASON when shortfalls are given and none matches)."""
    notes = [timing.note]
    if copy_bound is not None and as_shown(copy_bound) < target:
        notes.append(f"a copy of its bytes reaches {copy_bound:.2f}")
    if shortfalls is not None and not timing.note:
        found = first_shortfall(shortfalls, timing)
        notes.append(found.why if found else NO_REASON)
    return "; ".join(note for note in notes if note)


def against_targets(timings: list[Timing]) -> dict[str, tuple[float, list[Timing], list[Timing]]]:
    """Per backend (or variant) with a target: (target, the cells held to it, those below it as the tables show
    them)."""
    held = [t for t in timings if t.role == "backend" and target_of(t.impl) is not None
            and t.direction in TARGET_DIRECTIONS.get(t.op, ()) and ("headline" in t.group or t.group == "layout")]
    verdicts = {}
    for impl in dict.fromkeys(t.impl for t in held):
        cells = [t for t in held if t.impl == impl]
        target = target_of(impl)
        below = [t for t in cells if t.fraction_of_copy is None or as_shown(t.fraction_of_copy) < target]
        verdicts[impl] = target, cells, below
    return verdicts


def _targets_section(timings: list[Timing], shortfalls: list[Shortfall] | None = None) -> list[str]:
    """Per backend with a target: how many cells it is held to and falls below, then those cells, each with why
    (_shortfall_note)."""
    verdicts = against_targets(timings)
    if not verdicts:
        return []
    copies = {(t.shape, t.dtype, t.bytes): t.fraction_of_copy for t in timings if t.role == "copy"}
    why = ("Why each falls short, as measured: the note of each cell below (the first matching row of the "
           "shortfalls file, `--shortfalls`)." if shortfalls is not None else
           "No reasons were given (`--shortfalls`).")
    lines = ["## against the targets", "",
             "Cells held to a backend's target: "
             + "; ".join(f"{op} {', '.join(directions)}" for op, directions in TARGET_DIRECTIONS.items())
             + ", on the headline shapes and the layouts (not the sweep). Below a target: the cell, as the tables "
             f"show it (two decimals), is under it. {why}", "",
             "| backend | target | cells | below | below, by op and direction |", "|---|---:|---:|---:|---|"]
    for impl, (target, cells, below) in verdicts.items():
        counts = collections.Counter(f"{t.op} {t.direction}" for t in below)
        lines.append(f"| {impl} | {target:.2f} | {len(cells)} | {len(below)} | "
                     + ", ".join(f"{key} {count}" for key, count in counts.items()) + " |")
    lines.append("")
    for impl, (target, _, below) in verdicts.items():
        if not below:
            continue
        lines += [f"<details><summary>{impl}: the {len(below)} cells below {target:.2f}</summary>", "",
                  "| op | direction | shape | dtype | fraction of copy | note |", "|---|---|---|---|---:|---|"]
        for t in below:
            note = _shortfall_note(t, target, copies.get((t.shape, t.dtype, t.bytes)), shortfalls)
            lines.append(f"| {t.op} | {t.direction} | {t.shape} | {t.dtype} | {number(t.fraction_of_copy, 2)} | "
                         f"{note} |")
        lines += ["", "</details>", ""]
    return lines


def markdown_report(results: Results, shortfalls: list[Shortfall] | None = None) -> str:
    env = dict(results.environment)
    at_end = env.pop(COPY_AT_END, None)
    counted = env.pop(BYTES_COUNTED, BYTES_COUNTED_UNRECORDED)
    copy = results.copy_gb_per_s
    lines = ["# multisoft benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += [f"- copy bandwidth (`dst.copy_(src)`, {plan.COPY_BYTES >> 20} MiB, read + write): **{copy:.0f} GB/s**"
              + (f" ({at_end} at the end of the run)" if at_end else "") if copy else "- copy bandwidth: not measured",
              ""]
    eager = any(t.eager_ms is not None for t in results.timings)
    lines += ["Each cell is the achieved bandwidth as a fraction of that copy bandwidth"
              + (": **kernel / eager**. Kernel: timed as `timing` says, by default the GPU's work alone, host "
                 "time hidden (best of a row in bold). Eager: the same call timed as eager PyTorch runs it, host "
                 "time included (`eager timing`); where the host issues a call more slowly than the GPU runs it, "
                 "eager is lower."
                 if eager else " (best of a row in bold).")
              + f" Bytes counted: {counted}. "
              "Milliseconds and GB/s are in `timings.csv`; `—` = not timed (listed under each table).", ""]
    if env.get("timing", "").startswith(("triton.testing.do_bench", "torch.cuda.Event")):
        lines += ["These times include host overhead wherever the host launches a call more slowly than the GPU "
                  "runs it (small tensors, forward+backward through autograd); `--timer queued` times the GPU "
                  "work only.", ""]
    lines += headline_section(results) + _targets_section(results.timings, shortfalls)
    ops = list(dict.fromkeys(t.op for t in results.timings if t.role != "copy"))
    for op in ops:
        lines += _op_section(op, [t for t in results.timings if t.op == op])
    lines += linear_section(results.linear) + vocab_parallel_section(results.vocab_parallel)
    lines += train_step_section(results.train_step)
    lines += log_probs_section(results.log_probs)
    lines += linear_log_probs_section(results.linear_log_probs, results.environment.get(LIGER_LOG_PROBS))
    lines += _memory_section(results) + _first_calls_section(results) + _copies_section(results)
    lines += host_time_section(results.host_times)
    return "\n".join(lines)


def _memory_section(results: Results) -> list[str]:
    if not results.memory:
        return []
    lines = ["## cross_entropy: peak memory of forward+backward", "",
             "`torch.cuda.max_memory_allocated()` above what was allocated before the call (the logits "
             "themselves not counted).", "",
             "| shape | dtype | impl | peak (MiB) | × logits | note |", "|---|---|---|---:|---:|---|"]
    for m in results.memory:
        ratio = None if m.peak_mib is None else m.peak_mib / m.logits_mib
        lines.append(f"| {m.shape} | {m.dtype} | {m.impl} | {number(m.peak_mib, 0)} | {number(ratio, 2)} "
                     f"| {m.note} |")
    return lines + [""]


def _first_calls_section(results: Results) -> list[str]:
    if not results.first_calls:
        return []
    lines = ["## first call (compile) time", "",
             "Wall time of the first call of each op in this process, synchronised; the on-disk caches of "
             "Triton, CuPy and numba can make it shorter than a cold compile.", "",
             "| impl | op | direction | dtype | shape | first call (ms) | steady (ms) |",
             "|---|---|---|---|---|---:|---:|"]
    for f in results.first_calls:
        lines.append(f"| {f.impl} | {f.op} | {f.direction} | {f.dtype} | {f.shape} | {f.first_call_ms:.1f} | "
                     f"{number(f.steady_ms, 3)} |")
    return lines + [""]


def _copies_section(results: Results) -> list[str]:
    copies = [t for t in results.timings if t.role == "copy" and t.group == "headline"]
    if not copies:
        return []
    lines = ["## copy of each headline shape's bytes", "",
             "`dst.copy_(src)` of one input of each shape, as a fraction of the copy above: launch, ramp-up "
             "and tail leave about this much to any kernel that reads and writes that many bytes.", "",
             "| shape | dtype | MiB copied | fraction of copy | note |", "|---|---|---:|---:|---|"]
    for t in copies:
        mib = t.bytes / 2 / 2**20 if t.bytes else None
        lines.append(f"| {t.shape} | {t.dtype} | {number(mib, 0)} | {number(t.fraction_of_copy, 2)} | "
                     f"{t.note} |")
    return lines + [""]
