"""Per-token log-probabilities and entropy on logits (``--ops log_probs``, alias ``lp``): the forward+backward of a
typical reinforcement-learning per-token objective, ``(log_probs * g).sum() + (entropy * c).sum()`` with random
per-token ``g`` and ``c`` at temperature TEMPERATURE, per implementation, next to a copy of the logits' bytes; its
forward alone; its forward+backward without the entropy (what the entropy adds); its peak memory and its errors
against float64.

The implementations: each multisoft backend (``multisoft.log_probs(..., return_entropy=True)``) and torch's unfused
way (``torch_log_probs``: float32 ``log_softmax`` of the logits over the temperature, gathered at the targets, the
entropy ``-(p * log p).sum(-1)``). Liger-Kernel has no differentiable per-token log-probability of logits (its
``fused_selective_log_softmax`` is forward-only, without entropy): its fused op takes the hidden states and the
output layer, and is timed beside ``linear_log_probs``. One case's inputs are shared by all; a failure of one (out
of memory, an exception) is its record's note and the run goes on.
"""

from __future__ import annotations

from typing import Callable

from . import plan, timing
from .impls import TORCH_PEER, Impl
from .linear import peak_extra_gib
from .records import LogProbsRecord, describe_error

OP = "log_probs"
TEMPERATURE = 0.7
CELLS = [((8192, 151936), "bf16"), ((8192, 32000), "fp32")]  # ((M rows, V classes), dtype)
QUICK_CELLS = [((4096, 32000), "bf16"), ((4096, 32000), "fp32")]
COPY = "copy"  # the record of dst.copy_(src) of the logits
FLOOR_PASSES = {"forward": 1, "forward+backward": 3}  # passes over the logits' bytes: the op's floor
ERROR_CHUNK_BYTES = 256 << 20  # float64 logits of one chunk of rows of the reference
DIRECTIONS = ("forward", "forward+backward")


def shape_label(shape: tuple) -> str:
    return "x".join(str(size) for size in shape)


def cases(quick: bool, dtypes: list[str]) -> list[tuple]:
    """The (shape, dtype) cells timed: each of CELLS (QUICK_CELLS with ``quick``) whose dtype ``dtypes`` names."""
    return [(shape, dtype) for shape, dtype in (QUICK_CELLS if quick else CELLS) if dtype in dtypes]


def memory_needed(shape: tuple, dtype_name: str) -> int:
    """Bytes a case may hold at once, generously: the logits and their gradient, what the hungriest
    implementation adds (torch's unfused way: float32 arrays of the logits' size, the upcast logits, them over the
    temperature, their log_softmax, its exp, the product, and as many again in the backward: 10), and the float64
    reference's chunk (a dozen arrays of ERROR_CHUNK_BYTES)."""
    rows, classes = shape
    return rows * classes * (2 * plan.ELEMENT_SIZE[dtype_name] + 10 * 4) + 12 * ERROR_CHUNK_BYTES


def too_big(shape: tuple, dtype_name: str, device) -> str:
    """Why a case is skipped on ``device`` (it would not fit in the GPU's memory); "" when it is not."""
    return plan.memory_shortfall(memory_needed(shape, dtype_name), device)


# -- the implementations: make(op, inputs) gives f(logits, entropy) -> log_probs (M,), or with ``entropy``
# (log_probs, entropy), both (M,)


def torch_log_probs(logits, target, temperature: float, entropy: bool = True):
    """The per-token log-probabilities (and entropy) as a user without multisoft writes them in torch ops:
    ``lp = torch.log_softmax(logits.float() / temperature, -1)``, gathered at ``target``; the entropy
    ``-(lp.exp() * lp).sum(-1)``."""
    import torch

    lp = torch.log_softmax(logits.float() / temperature, -1)
    picked = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked
    return picked, -(lp.exp() * lp).sum(-1)


def backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        target = inputs["target"]
        return lambda x, entropy=True: multisoft.log_probs(x, target, temperature=TEMPERATURE,
                                                           return_entropy=entropy, backend=name)
    return Impl(name, "backend", (OP,), make, directions=DIRECTIONS)


def torch_native_peer() -> Impl:
    def make(op, inputs):
        target = inputs["target"]
        return lambda x, entropy=True: torch_log_probs(x, target, TEMPERATURE, entropy)
    return Impl(TORCH_PEER, "peer", (OP,), make, directions=DIRECTIONS)


def choose_impls(backends: list[str], peers: bool) -> list[Impl]:
    """Each backend, then (with ``peers``) torch's unfused way."""
    return [backend_impl(name) for name in backends] + ([torch_native_peer()] if peers else [])


# -- inputs, the steps timed, the float64 reference


def make_inputs(shape: tuple, dtype_name: str, device) -> dict:
    """Logits (M, V) of ``dtype_name`` (standard normal), random class targets (M,) and the incoming per-token
    gradients g and c (M,), float32 standard normal."""
    import torch

    rows, classes = shape
    dtype = getattr(torch, plan.DTYPES[dtype_name])
    return {"x": torch.randn(rows, classes, device=device, dtype=dtype),
            "target": torch.randint(0, classes, (rows,), device=device),
            "g": torch.randn(rows, device=device), "c": torch.randn(rows, device=device)}


def objective(f: Callable, x, g, c, entropy: bool = True):
    """``(log_probs * g).sum() + (entropy * c).sum()`` of ``f(x)``; without ``entropy`` ``(log_probs * g).sum()``
    of ``f(x, entropy=False)``."""
    if not entropy:
        return (f(x, False) * g).sum()
    log_probs, row_entropy = f(x, True)
    return (log_probs * g).sum() + (row_entropy * c).sum()


def training_step(f: Callable, leaf, g, c, entropy: bool = True) -> Callable:
    """One eager step: ``leaf.grad = None``, then ``objective(...).backward()`` (a new graph each call)."""
    def step():
        leaf.grad = None
        objective(f, leaf, g, c, entropy).backward()
    return step


def largest_difference(value, expected) -> float:
    """max |value - expected| in float64, a NaN or infinity of ``value`` counted as infinite."""
    return (value.double() - expected).abs_().nan_to_num_(float("inf")).max().item()


def errors(logits, target, g, c, log_probs, entropy, grad) -> tuple[float, float, float]:
    """The errors of ``log_probs``, ``entropy`` and the logits' gradient ``grad`` (of the objective with ``g``
    and ``c``) against float64 (``multisoft.check.reference_log_probs`` and ``reference_log_probs_gradient``), a
    chunk of rows at a time (a chunk's float64 logits at most ERROR_CHUNK_BYTES), over every row: each the
    largest |value - reference| over the reference's largest absolute value."""
    from ..check import reference_log_probs, reference_log_probs_gradient

    rows, classes = logits.shape
    chunk = max(1, ERROR_CHUNK_BYTES // (classes * 8))
    worst, scale = [0.0] * 3, [0.0] * 3
    for start in range(0, rows, chunk):
        part = slice(start, min(start + chunk, rows))
        expected = reference_log_probs(logits[part], target[part], temperature=TEMPERATURE, return_entropy=True)
        expected_grad, _ = reference_log_probs_gradient(logits[part], target[part], g[part], c[part],
                                                        temperature=TEMPERATURE)
        for i, (value, reference) in enumerate(zip((log_probs[part], entropy[part], grad[part]),
                                                   (*expected, expected_grad))):
            worst[i] = max(worst[i], largest_difference(value, reference))
            scale[i] = max(scale[i], reference.abs().max().item())
        del expected, expected_grad
    return tuple(w / s if s else w for w, s in zip(worst, scale))


def fraction(nbytes: int, ms: float | None, copy_gb_per_s: float | None) -> float | None:
    """The bandwidth of ``nbytes`` in ``ms`` as a fraction of the copy bandwidth (None without either)."""
    if not ms or not copy_gb_per_s:
        return None
    return plan.gb_per_s(nbytes, ms) / copy_gb_per_s


# -- a run


def run_cases(runner, chosen: list[Impl], cells: list[tuple], copy_gb_per_s: float | None, timer: Callable,
              eager_timer: Callable | None) -> list[LogProbsRecord]:
    """Every (shape, dtype) of ``cells``: the copy of the logits, then each of ``chosen``; each call timed by
    ``timer`` (fn -> ms, the kernel time) and ``eager_timer`` (the eager wall time; None: the kernel time is
    it)."""
    records = []
    for shape, dtype_name in cells:
        records += run_case(runner, chosen, shape, dtype_name, copy_gb_per_s, timer, eager_timer)
    return records


def run_case(runner, chosen: list[Impl], shape: tuple, dtype_name: str, copy_gb_per_s: float | None,
             timer: Callable, eager_timer: Callable | None) -> list[LogProbsRecord]:
    """One case: its inputs, made once and shared; the copy's record, then one per implementation (a case that
    does not fit, or whose inputs fail, gives every record the reason)."""
    rows, classes = shape
    common = dict(dtype=dtype_name, shape=shape_label(shape), pass_bytes=rows * classes * plan.ELEMENT_SIZE[dtype_name])
    copy = LogProbsRecord(COPY, "copy", **common)
    records = [copy] + [LogProbsRecord(impl.name, impl.role, **common) for impl in chosen]
    inputs = timing.case_inputs(runner, OP, dtype_name, records, too_big(shape, dtype_name, runner.device),
                                lambda: make_inputs(shape, dtype_name, runner.device))
    if inputs is None:
        return records
    runner.progress.step(f"{OP} {dtype_name} {copy.shape} {COPY}")
    _measure_copy(runner, copy, inputs, copy_gb_per_s, timer, eager_timer)
    for impl, record in zip(chosen, records[1:]):
        runner.progress.step(f"{OP} {dtype_name} {record.shape} {impl.name}")
        record.note = runner.skip_reason(impl, OP, dtype_name)
        if not record.note:
            _measure(runner, impl, record, inputs, copy_gb_per_s, timer, eager_timer)
    del inputs
    timing.recover()
    return records


def _times(fn: Callable, timer: Callable, eager_timer: Callable | None) -> tuple[float, float]:
    """(kernel ms, eager ms) of ``fn``, one right after the other."""
    ms = timer(fn)
    return ms, ms if eager_timer is None else eager_timer(fn)


def _measure_copy(runner, record: LogProbsRecord, inputs: dict, copy_gb_per_s, timer, eager_timer) -> None:
    """``dst.copy_(src)`` of the logits: its bytes read and written, 2 × pass_bytes, against the long copy."""
    import torch

    try:
        src = inputs["x"]
        dst = torch.empty_like(src)
        record.ms, record.eager_ms = _times(lambda: dst.copy_(src), timer, eager_timer)
        record.fraction_of_copy = fraction(2 * record.pass_bytes, record.ms, copy_gb_per_s)
        record.eager_fraction = fraction(2 * record.pass_bytes, record.eager_ms, copy_gb_per_s)
    except Exception as error:  # noqa: BLE001
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {record.impl}: {record.note}")
    dst = None
    timing.recover()


def _measure(runner, impl: Impl, record: LogProbsRecord, inputs: dict, copy_gb_per_s, timer, eager_timer) -> None:
    """The forward alone (logits that do not require grad), the objective's forward+backward, the same without
    the entropy; then one more forward+backward whose peak memory is taken and whose outputs and gradient are
    compared with float64."""
    x, target, g, c = inputs["x"], inputs["target"], inputs["g"], inputs["c"]
    leaf = x.detach().requires_grad_(True)
    outputs = []
    try:
        f = impl.make(OP, inputs)
        record.forward_ms, record.forward_eager_ms = _times(lambda: f(x, True), timer, eager_timer)
        record.ms, record.eager_ms = _times(training_step(f, leaf, g, c), timer, eager_timer)
        record.no_entropy_ms, record.no_entropy_eager_ms = _times(training_step(f, leaf, g, c, entropy=False),
                                                                  timer, eager_timer)
        passes = FLOOR_PASSES["forward+backward"] * record.pass_bytes
        record.fraction_of_copy = fraction(passes, record.ms, copy_gb_per_s)
        record.eager_fraction = fraction(passes, record.eager_ms, copy_gb_per_s)
        passes = FLOOR_PASSES["forward"] * record.pass_bytes
        record.forward_fraction = fraction(passes, record.forward_ms, copy_gb_per_s)
        record.forward_eager_fraction = fraction(passes, record.forward_eager_ms, copy_gb_per_s)
        leaf.grad = None
        record.extra_gib = peak_extra_gib(lambda: outputs.append(_step_outputs(f, leaf, g, c)), runner.device)
        log_probs, entropy = outputs[0]
        record.log_probs_error, record.entropy_error, record.grad_error = errors(x, target, g, c, log_probs, entropy,
                                                                                 leaf.grad)
    except Exception as error:  # noqa: BLE001 - record it (out of memory, a failing kernel) and go on
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {impl.name}: {record.note}")
    leaf.grad = None
    outputs.clear()
    timing.recover()


def _step_outputs(f: Callable, leaf, g, c) -> tuple:
    """One forward+backward of the objective: its log-probabilities and entropy, detached."""
    log_probs, entropy = f(leaf, True)
    ((log_probs * g).sum() + (entropy * c).sum()).backward()
    return log_probs.detach(), entropy.detach()
