"""results.md's fused linear cross-entropy section: one table per case (shape and dtype), each multisoft backend
against its targets."""

from __future__ import annotations

from .cells import as_shown
from .impls import LIGER_PEER
from .linear import CCE_PEER
from .records import LinearRecord

TIME_TARGET = 1.10  # a backend's forward+backward, as a multiple of the three matrix products alone
MEMORY_TARGET = 1 / 8  # a backend's memory beyond the two gradients, as a fraction of the logits' size
MEMORY_PEERS = (LIGER_PEER, CCE_PEER)  # whose memory beyond the gradients a backend's must not exceed


def target_misses(record: LinearRecord, case: list[LinearRecord]) -> list[str]:
    """The targets a backend's ``record`` misses among the records of its ``case`` ([]: all met): time at most
    TIME_TARGET x the products (as the table shows it, two decimals), memory beyond the gradients at most
    MEMORY_TARGET of the logits and at most each of MEMORY_PEERS' (where memory was measured), faster than every
    peer timed."""
    if record.ms is None:
        return ["not timed"]
    misses = []
    if record.of_products is None or as_shown(record.of_products) > TIME_TARGET:
        ratio = "no products time" if record.of_products is None else f"{record.of_products:.2f}x products"
        misses.append(f"time: {ratio} > {TIME_TARGET:.2f}x")
    beyond = record.beyond_gradients_gib
    if beyond is not None:
        if record.of_logits > MEMORY_TARGET:
            misses.append(f"memory: {record.of_logits:.3f} of the logits > 1/8")
        misses += [f"memory: more than {peer.impl}'s {peer.beyond_gradients_gib:.2f} GiB" for peer in case
                   if peer.impl in MEMORY_PEERS and peer.beyond_gradients_gib is not None
                   and beyond > peer.beyond_gradients_gib]
    slower_than = [peer.impl for peer in case if peer.role == "peer" and peer.ms is not None and peer.ms <= record.ms]
    if slower_than:
        misses.append(f"not faster than {', '.join(slower_than)}")
    return misses


def _number(value, style: str) -> str:
    return "—" if value is None else format(value, style)


def verdict(record: LinearRecord, case: list[LinearRecord]) -> str:
    """The last column of a row: a peer's note; a backend's note, and the targets it meets or misses."""
    if record.role != "backend":
        return record.note
    misses = target_misses(record, case)
    outcome = "met" if not misses else "missed: " + "; ".join(misses)
    if record.ms is not None and record.extra_gib is None:
        outcome += " (memory not measured)"
    return "; ".join(text for text in (record.note, outcome) if text)


def case_table(case: list[LinearRecord]) -> list[str]:
    """One case's table: a row per implementation (the products first), and its heading."""
    first = case[0]
    lines = [f"### {first.shape} {first.dtype}", "",
             f"Logits {first.logits_gib:.2f} GiB, the two gradients {first.gradients_gib:.2f} GiB.", "",
             "| impl | ms | × products | extra GiB | beyond gradients GiB | × logits | loss error | input.grad error "
             "| weight.grad error | targets, note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in case:
        lines.append(f"| {r.impl} | {_number(r.ms, '.2f')} | {_number(r.of_products, '.2f')} | "
                     f"{_number(r.extra_gib, '.2f')} | {_number(r.beyond_gradients_gib, '.2f')} | "
                     f"{_number(r.of_logits, '.3f')} | {_number(r.loss_error, '.1e')} | "
                     f"{_number(r.grad_input_error, '.1e')} | {_number(r.grad_weight_error, '.1e')} | "
                     f"{verdict(r, case)} |")
    return lines + [""]


def linear_section(records: list[LinearRecord]) -> list[str]:
    """The section: what is measured and the targets, then case_table of each (shape, dtype) in run order."""
    if not records:
        return []
    lines = ["## Fused linear cross-entropy", "",
             "A training step of `reduction=\"mean\"` cross-entropy of `x @ w.T` (x: M x H hidden states, w: V x H; "
             "shapes M x H x V), both requiring grad: `.grad = None`, then the loss and `backward()`, eager, timed "
             "as `timing` says (L2 cleared before each call). `products`: the three matrix products alone, "
             "`x @ w.T` into a preallocated g, `g @ w` and `g.T @ x`, the floor of any implementation. "
             "Extra: the peak memory allocated during one step beyond what was allocated before it (the inputs), "
             "the two gradients included; beyond gradients: that less the gradients' bytes, and as a fraction of "
             "the logits' size (M·V × element size). Errors: max |value − float64 reference| / max |reference| of "
             "the loss, x's gradient and w's gradient. Each multisoft backend's targets: time ≤ "
             f"{TIME_TARGET:.2f}× the products, memory beyond the gradients ≤ 1/8 of the logits and ≤ that of "
             f"{' and '.join(MEMORY_PEERS)}, faster than every peer. `linear_cross_entropy.csv` has every number.",
             ""]
    cases: dict[tuple, list[LinearRecord]] = {}
    for record in records:
        cases.setdefault((record.shape, record.dtype), []).append(record)
    for case in cases.values():
        lines += case_table(case)
    return lines
