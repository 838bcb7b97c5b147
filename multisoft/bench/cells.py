"""How a record reads in the tables of results.md: the order of the columns, a fraction of copy, a number."""

from __future__ import annotations

from .records import Timing


def as_shown(fraction: float) -> float:
    """A fraction of copy as the tables show it: two decimals."""
    return float(f"{fraction:.2f}")


def impl_order(timings: list[Timing]) -> list[str]:
    """Backends first, then peers, each in the order they were run."""
    backends = [t.impl for t in timings if t.role == "backend"]
    peers = [t.impl for t in timings if t.role == "peer"]
    return list(dict.fromkeys(backends + peers))


def _fraction(fraction: float | None, ms: float | None, nbytes: int) -> str:
    """A fraction of copy as the tables show it; GB/s where the copy was not measured; "—" without a time."""
    if fraction is not None:
        return f"{fraction:.2f}"
    return "—" if not ms else f"{nbytes / (ms * 1e6):.0f} GB/s"


def fraction_cell(record: Timing | None, best: float | None = None, eager: bool = False) -> str:
    """A table's cell: the kernel fraction of copy (bold when it is the row's ``best``), with ``eager`` then
    " / " and the eager fraction; "error" or "—" (not timed) without a kernel time."""
    if record is None or (record.ms is None and not record.note.startswith("error")):
        return "—"
    if record.ms is None:
        return "error"
    text = _fraction(record.fraction_of_copy, record.ms, record.bytes)
    if best is not None and record.fraction_of_copy == best:
        text = f"**{text}**"
    return f"{text} / {_fraction(record.eager_fraction, record.eager_ms, record.bytes)}" if eager else text


def number(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"
