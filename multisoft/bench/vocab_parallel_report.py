"""results.md's vocabulary-parallel cross-entropy section: a row per backend, dtype and shape, the split call's time
against the unsplit call's and the target."""

from __future__ import annotations

from .cells import as_shown, number
from .records import VocabParallelRecord
from .vocab_parallel import TARGET


def verdict(record: VocabParallelRecord) -> str:
    """The target's verdict (the split call's time, as the table shows it, at most TARGET of the unsplit call's),
    after the record's note; only the note when it was not timed."""
    if record.of_unsplit is None:
        return record.note or "not timed"
    shown = as_shown(record.of_unsplit)
    met = "met" if shown <= TARGET else f"missed: {shown:.2f}× > {TARGET:.2f}×"
    return "; ".join(text for text in (record.note, met) if text)


def _error(value) -> str:
    return "—" if value is None else f"{value:.1e}"


def vocab_parallel_section(records: list[VocabParallelRecord]) -> list[str]:
    """The section: what is measured and the target, then the table, in run order."""
    if not records:
        return []
    ranks = records[0].ranks
    lines = ["## Vocabulary-parallel cross-entropy", "",
             "A training step's forward+backward of `reduction=\"mean\"` cross-entropy (`x.grad = None`, the loss of "
             "logits requiring grad, `loss.backward()`) with the V classes split over the ranks, one process per "
             "GPU (NCCL): **split**, `multisoft.cross_entropy(x_r, target, backend=b, process_group=group)` on each "
             "rank's V/ranks contiguous columns x_r (pass 1, one all-gather of (4, M) float32 row statistics, "
             "pass 2), the slowest rank's time (each rank's in `vocab_parallel.csv`); **unsplit**, "
             "`multisoft.cross_entropy(x, target, backend=b)` on all V columns on one GPU; **collective**, that "
             "all-gather alone. Timed as `vocab_parallel timing` says. Each rank reads the logits and writes the "
             f"gradient of V/{ranks} of the columns, so the split call's floor is about 1/{ranks} = "
             f"{1 / ranks:.2f}× the unsplit call's (plus the collective); the target: split ≤ {TARGET:.2f}× unsplit "
             "(two decimals, as shown). Errors (of the split call, checked before it is timed; a call past the "
             "dtype's tolerance is not timed): the loss's relative error and the gradient's max |value − "
             "reference| / max |reference|, the worst rank's, against float64.", "",
             "| backend | dtype | shape | ranks | unsplit ms | split ms | each rank ms | split / unsplit "
             "| collective ms | collective / split | loss error | gradient error | target, note |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        lines.append(f"| {r.impl} | {r.dtype} | {r.shape} | {r.ranks} | {number(r.unsplit_ms, 3)} | "
                     f"{number(r.split_ms, 3)} | {r.rank_ms or '—'} | {number(r.of_unsplit, 2)} | "
                     f"{number(r.collective_ms, 3)} | {number(r.collective_share, 2)} | {_error(r.loss_error)} | "
                     f"{_error(r.grad_error)} | {verdict(r)} |")
    return lines + [""]
