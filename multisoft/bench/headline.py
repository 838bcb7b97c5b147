"""What an eager PyTorch user gets, for results.md: the headline summary (kernel and eager fraction of copy of the
headline cells, with the host time a call) and the host time a call of every implementation."""

from __future__ import annotations

from . import plan
from .cells import fraction_cell, impl_order, number
from .impls import TORCH_PEER
from .records import HostTime, Results, Timing

HOST_SECTION = "host time a call"


def headline_cells() -> list[tuple[str, str, str]]:
    """(op, dtype, shape label) of each of plan.HEADLINE_CELLS."""
    return [(op, dtype, f"{rows}x{cols}") for op, dtype, (rows, cols) in plan.HEADLINE_CELLS]


def _host_cell(record: HostTime | None, digits: int) -> str:
    if record is None or (record.us is None and not record.note.startswith("error")):
        return "—"
    return "error" if record.us is None else number(record.us, digits)


def _described(host_times: list[HostTime]) -> str:
    """The inputs the host times were taken on, e.g. "8x128 fp32"."""
    return ", ".join(dict.fromkeys(f"{h.shape} {h.dtype}" for h in host_times))


def headline_section(results: Results) -> list[str]:
    """Per implementation: kernel / eager fraction of copy of forward+backward on each headline cell that was
    timed, then the host µs of a forward+backward call of each op; nothing when no headline cell was timed."""
    direction = plan.SUMMARY_DIRECTION
    wanted = headline_cells()
    timed = [t for t in results.timings if t.direction == direction and t.role != "copy"
             and (t.op, t.dtype, t.shape) in wanted]
    # a shape timed twice (the headline's and the sweep's) shows the headline's
    found: dict[tuple, Timing] = {(t.op, t.dtype, t.shape, t.impl): t
                                  for t in sorted(timed, key=lambda t: "headline" in t.group)}
    if not found:
        return []
    cells = [cell for cell in wanted if any(key[:3] == cell for key in found)]
    eager = any(t.eager_ms is not None for t in found.values())
    impls = impl_order(list(found.values()))
    host = [h for h in results.host_times if h.direction == direction]
    host_by_key = {(h.impl, h.op): h for h in host}
    host_ops = list(dict.fromkeys(h.op for h in host))
    copy = f" ({results.copy_gb_per_s:.0f} GB/s)" if results.copy_gb_per_s else ""
    gpu = results.environment.get("gpu")
    lines = [f"## headline: what a user gets{f' on {gpu}' if gpu else ''}", "",
             f"{direction}, as a fraction of the copy bandwidth{copy}: "
             + ("**kernel / eager**. Kernel: the GPU's work alone. Eager: the same call as eager PyTorch makes it, "
                "host time included. " if eager else "the kernel time, the GPU's work alone (no eager times). ")
             + (f"Host µs: wall-clock microseconds a {direction} call (input {_described(host)}), where the "
                f"host sets the pace ([{HOST_SECTION}](#{HOST_SECTION.replace(' ', '-')})). " if host else "")
             + f"`{TORCH_PEER}`: `torch.softmax` and `F.cross_entropy`; `<backend> inplace`: "
             "`multisoft.cross_entropy(..., inplace_backward=True)`.", "",
             "| impl | " + " | ".join(" ".join(cell) for cell in cells)
             + "".join(f" | host µs {op}" for op in host_ops) + " |",
             "|---|" + "---:|" * (len(cells) + len(host_ops))]
    for impl in impls:
        row = [fraction_cell(found.get((*cell, impl)), eager=eager) for cell in cells]
        row += [_host_cell(host_by_key.get((impl, op)), 0) for op in host_ops]
        lines.append(f"| {impl} | " + " | ".join(row) + " |")
    return lines + [""]


def host_time_section(host_times: list[HostTime]) -> list[str]:
    """One row per implementation, one column per (op, direction) measured, then a backend's softmax forward kernel
    called alone and what the front adds to it; the notes of the rows that have one."""
    if not host_times:
        return []
    columns = list(dict.fromkeys((h.op, h.direction) for h in host_times))
    by_key = {(h.impl, h.op, h.direction): h for h in host_times}
    kernels = {h.impl: h for h in host_times if h.kernel_us is not None}
    lines = [f"## {HOST_SECTION}", "",
             f"Wall-clock µs a call (input {_described(host_times)}), the mean of many calls synchronised only "
             "before the first and after the last (`host time` above): the GPU's work of such a call takes a few "
             "µs, so this is what the host spends (Python, checks, allocation, autograd, launches), the floor of a "
             "call however small its tensor. forward: `f(x)`; forward+backward: `f(x)` of an `x` that requires "
             "grad, then `loss.backward()` (softmax: `y.backward(g)`, `g` allocated once), `x.grad` cleared before "
             "each call."
             + (" Kernel alone: the backend's softmax kernel `forward(x, out, False)` called directly; front: what "
                "`multisoft.softmax` adds to it (checks, allocation, dispatch)." if kernels else ""), "",
             "| impl | " + " | ".join(f"{op} {direction}" for op, direction in columns)
             + (" | softmax forward, kernel alone | front" if kernels else "") + " |",
             "|---|" + "---:|" * (len(columns) + (2 if kernels else 0))]
    for impl in impl_order(host_times):
        row = [_host_cell(by_key.get((impl, op, direction)), 1) for op, direction in columns]
        if kernels:
            kernel = kernels.get(impl)
            row += [number(kernel.kernel_us), number(kernel.front_us)] if kernel else ["—", "—"]
        lines.append(f"| {impl} | " + " | ".join(row) + " |")
    notes = [f"- {h.impl} {h.op} {h.direction}: {h.note}" for h in host_times if h.note]
    return lines + ([""] + notes if notes else []) + [""]
