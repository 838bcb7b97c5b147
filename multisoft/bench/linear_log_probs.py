"""Fused per-token log-probabilities of a language model's last layer (``--ops linear_log_probs``, alias ``llp``):
the forward+backward of the reinforcement-learning per-token objective of ``log_probs`` (``(log_probs * g).sum() +
(entropy * c).sum()``, temperature log_probs.TEMPERATURE) of the logits ``x @ w.T`` into the gradients of the
hidden states x and the weight w (no bias), per implementation, next to the four matrix products alone (the floor),
with its peak memory and its errors against float64.

Four products, not linear cross-entropy's three: the incoming per-token gradients g and c are not known in the
forward, so a fused op that keeps no logits computes them again in the backward (``products_step``).

The implementations: each multisoft backend (``multisoft.linear_log_probs(..., return_entropy=True)``), torch's
unfused way on ``F.linear``'s logits upcast to float32 (``log_probs.torch_log_probs``), and Liger-Kernel's
``LigerFusedLinearScaledCrossEntropyFunction`` (Liger-Kernel 0.8.2 on) where it imports: its per-token operator of
``input[M, H]``, ``weight[V, H]`` and ``target[M]`` at a temperature, which returns the negative log-likelihood
(float32, the log-probability's negative) and, with ``return_entropy``, the entropy (in the input's dtype), both
differentiable with per-token gradients. Its front dispatches on the GPU: on compute capability 9.0 (H100, H200) to
its CuTe DSL kernels (``LigerFusedScaledCrossEntropySM90Function``, which needs the ``cutedsl`` extra, CUTLASS's
Python DSL), elsewhere to a chunked torch fallback; the run's environment says which (``liger_note``). One case's
inputs are shared by all; a failure of one (out of memory, an exception) is its record's note and the run goes on.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from . import plan, timing
from .impls import LIGER_PEER, TORCH_PEER, Impl
from .linear import peak_extra_gib
from .log_probs import TEMPERATURE, largest_difference, torch_log_probs
from .records import LIGER_LOG_PROBS, LinearLogProbsRecord, describe_error

OP = "linear_log_probs"
CELLS = [((8192, 4096, 131072), "bf16"), ((16384, 4096, 151936), "bf16")]  # ((M tokens, H hidden, V vocabulary), dtype)
QUICK_CELLS = [((4096, 4096, 32000), "bf16")]
PRODUCTS = "products"
LIGER_CLASS = "LigerFusedLinearScaledCrossEntropyFunction"
IGNORE_INDEX = -100
REFERENCE_CHUNK_BYTES = 256 << 20  # float64 logits of one chunk of rows of the reference
TIMING = ("timing.long_call_ms: median of CUDA events over 3 to 10 calls (as many as fit in 1 s) after a warm-up "
          "call and a sizing call, L2 cleared before each call, host time included")


def shape_label(shape: tuple) -> str:
    return "x".join(str(size) for size in shape)


def cases(quick: bool, dtypes: list[str]) -> list[tuple]:
    """The (shape, dtype) cells timed: each of CELLS (QUICK_CELLS with ``quick``) whose dtype ``dtypes`` names."""
    return [(shape, dtype) for shape, dtype in (QUICK_CELLS if quick else CELLS) if dtype in dtypes]


def memory_needed(shape: tuple, dtype_name: str) -> int:
    """Bytes the case itself holds at once: x and w, their gradients, and while the errors are taken the float64
    reference (x, w and w's gradient in float64, a dozen float64 arrays of a chunk's logits). An implementation
    that needs more (torch's unfused way holds float32 arrays of the logits' size: 60 GiB at 16384 x 151936) and
    does not fit gets its own out-of-memory note; the case is skipped only when this does not fit."""
    rows, hidden, classes = shape
    inputs = (rows + classes) * hidden * plan.ELEMENT_SIZE[dtype_name]
    return 2 * inputs + (rows + 2 * classes) * hidden * 8 + 12 * REFERENCE_CHUNK_BYTES


def too_big(shape: tuple, dtype_name: str, device) -> str:
    """Why a case is skipped on ``device`` (it would not fit in the GPU's memory); "" when it is not."""
    return plan.memory_shortfall(memory_needed(shape, dtype_name), device)


# -- the implementations: make(op, inputs) gives f(x, w) -> (log_probs (M,), entropy (M,))


def backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        target = inputs["target"]
        return lambda x, w: multisoft.linear_log_probs(x, w, target, temperature=TEMPERATURE, return_entropy=True,
                                                       backend=name)
    return Impl(name, "backend", (OP,), make, directions=("forward+backward",))


def torch_native_peer() -> Impl:
    """``log_probs.torch_log_probs`` of ``F.linear(x, w)``: the logits in full, upcast to float32."""
    def make(op, inputs):
        import torch.nn.functional as F

        target = inputs["target"]
        return lambda x, w: torch_log_probs(F.linear(x, w), target, TEMPERATURE)
    return Impl(TORCH_PEER, "peer", (OP,), make, directions=("forward+backward",))


def _liger_dispatch(module) -> str:
    """What Liger's front picks on the current GPU (its private ``_resolve_implementation``), or why that is not
    known."""
    import torch

    resolve = getattr(module, "_resolve_implementation", None)
    if resolve is None or not torch.cuda.is_available():
        return "its dispatch on this GPU not known"
    try:
        return f"on this GPU: {resolve(torch.device('cuda')).__name__}"
    except Exception as error:  # noqa: BLE001 - e.g. the SM90 kernels' CuTe DSL is not installed
        return f"on this GPU its kernels do not import ({describe_error(error)})"


def liger_peer() -> tuple[Impl | None, str]:
    """Liger-Kernel's ``LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, target, temperature, -100, 1,
    True)`` (the 1: ``m_tiles_per_cluster``, its default) giving (negative log-likelihood, entropy), called as
    (log-probabilities = -nll, entropy); or None and why not."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    try:
        import liger_kernel.ops.fused_linear_scaled_cross_entropy as module
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as function
    except Exception as error:  # noqa: BLE001 - any import failure just leaves the peer out
        return None, f"{version}, {LIGER_CLASS} not importable ({describe_error(error)}; it is in 0.8.2 on)"

    def make(op, inputs):
        target = inputs["target"]

        def call(x, w):
            nll, entropy = function.apply(x, w, target, TEMPERATURE, IGNORE_INDEX, 1, True)
            return -nll, entropy
        return call
    note = f"{version}, {LIGER_CLASS} ({_liger_dispatch(module)})"
    return Impl(LIGER_PEER, "peer", (OP,), make, directions=("forward+backward",)), note


def choose_impls(backends: list[str], peers: bool) -> tuple[list[Impl], dict]:
    """Each backend, then (with ``peers``) torch's unfused way and Liger's fused op where it imports; and the
    environment's note of Liger's."""
    chosen = [backend_impl(name) for name in backends]
    if not peers:
        return chosen, {}
    chosen.append(torch_native_peer())
    liger, note = liger_peer()
    if liger is not None:
        chosen.append(liger)
    return chosen, {LIGER_LOG_PROBS: note}


# -- inputs, the steps timed, the float64 reference


def make_inputs(shape: tuple, dtype_name: str, device) -> dict:
    """x (M, H) and w (V, H) of ``dtype_name``, both requiring grad, w scaled by H**-0.5 so that the logits have
    about unit variance; random class targets (M,); the incoming per-token gradients g and c (M,), float32
    standard normal."""
    import torch

    rows, hidden, classes = shape
    dtype = getattr(torch, plan.DTYPES[dtype_name])
    x = torch.randn(rows, hidden, device=device, dtype=dtype).requires_grad_(True)
    w = torch.randn(classes, hidden, device=device, dtype=dtype).mul_(hidden ** -0.5).requires_grad_(True)
    return {"x": x, "w": w, "target": torch.randint(0, classes, (rows,), device=device),
            "g": torch.randn(rows, device=device), "c": torch.randn(rows, device=device)}


def objective(f: Callable, x, w, g, c):
    """``(log_probs * g).sum() + (entropy * c).sum()`` of ``f(x, w)``."""
    log_probs, entropy = f(x, w)
    return (log_probs * g).sum() + (entropy * c).sum()


def training_step(f: Callable, x, w, g, c) -> Callable:
    """One eager step: the gradients cleared (``.grad = None``), ``objective(...).backward()``."""
    def step():
        x.grad = None
        w.grad = None
        objective(f, x, w, g, c).backward()
    return step


def products_step(x, w, logits) -> Callable:
    """The four matrix products alone, the floor of a fused op that keeps no logits: the logits ``x @ w.T`` (into
    ``logits``), the same again (the backward's), ``logits @ w`` and ``logits.T @ x`` (the two gradients, allocated
    as an implementation allocates them)."""
    import torch

    x, w = x.detach(), w.detach()

    def step():
        torch.mm(x, w.t(), out=logits)
        torch.mm(x, w.t(), out=logits)
        torch.mm(logits, w)
        torch.mm(logits.t(), x)
    return step


def errors(x, w, target, g, c, log_probs, entropy, grad_x, grad_w) -> tuple[float, float, float, float]:
    """The errors of the log-probabilities, the entropy and the gradients of x and w against float64, a chunk of
    rows at a time (a chunk's float64 logits at most REFERENCE_CHUNK_BYTES), over every row: each chunk's logits
    take the values F.linear gives in the inputs' dtype (``multisoft.check.reference_linear_logits``' rule: that
    rounding belongs to the function), ``check.reference_log_probs`` gives its outputs and
    ``check.reference_log_probs_gradient`` the logits' gradient, which gives the chunk's rows of x's gradient
    (``@ w``) and is accumulated into w's (``.T @ x``), all in float64. Each error: the largest |value -
    reference| over the reference's largest absolute value."""
    import torch
    import torch.nn.functional as F

    from ..check import reference_log_probs, reference_log_probs_gradient

    rows, classes = x.shape[0], w.shape[0]
    x, w = x.detach(), w.detach()
    x64, w64 = x.double(), w.double()
    grad_w64 = torch.zeros_like(w64)
    rounded = x.dtype in (torch.float16, torch.bfloat16)
    chunk = max(1, REFERENCE_CHUNK_BYTES // (classes * 8))
    worst, scale = [0.0] * 4, [0.0] * 4
    for start in range(0, rows, chunk):
        part = slice(start, min(start + chunk, rows))
        logits = F.linear(x[part], w).double() if rounded else x64[part] @ w64.t()
        expected = reference_log_probs(logits, target[part], temperature=TEMPERATURE, return_entropy=True)
        grad_logits, _ = reference_log_probs_gradient(logits, target[part], g[part], c[part], temperature=TEMPERATURE)
        expected_grad_x = grad_logits @ w64
        grad_w64.addmm_(grad_logits.t(), x64[part])
        for i, (value, reference) in enumerate(zip((log_probs[part], entropy[part], grad_x[part]),
                                                   (*expected, expected_grad_x))):
            worst[i] = max(worst[i], largest_difference(value, reference))
            scale[i] = max(scale[i], reference.abs().max().item())
        del logits, expected, grad_logits, expected_grad_x
    del x64, w64
    weight_chunk = max(1, REFERENCE_CHUNK_BYTES // (w.shape[1] * 8))
    for start in range(0, classes, weight_chunk):
        part = slice(start, start + weight_chunk)
        worst[3] = max(worst[3], largest_difference(grad_w[part], grad_w64[part]))
    scale[3] = grad_w64.abs().max().item()
    return tuple(value / size if size else value for value, size in zip(worst, scale))


# -- a run


def run_cases(runner, chosen: list[Impl], cells: list[tuple], timer: Callable) -> list[LinearLogProbsRecord]:
    """Every (shape, dtype) of ``cells``: the products, then each of ``chosen``, each step timed by ``timer``
    (fn -> ms); records with ``of_products`` set."""
    records = []
    for shape, dtype_name in cells:
        records += run_case(runner, chosen, shape, dtype_name, timer)
    return records


def run_case(runner, chosen: list[Impl], shape: tuple, dtype_name: str, timer: Callable) -> list[LinearLogProbsRecord]:
    """One case: its inputs, made once and shared; the products' record, then one per implementation (a case that
    does not fit, or whose inputs fail, gives every record the reason)."""
    rows, hidden, classes = shape
    size = plan.ELEMENT_SIZE[dtype_name]
    common = dict(dtype=dtype_name, shape=shape_label(shape), gradients_gib=(rows + classes) * hidden * size / 2**30,
                  logits_gib=rows * classes * size / 2**30)
    products = LinearLogProbsRecord(PRODUCTS, "floor", **common)
    records = [products] + [LinearLogProbsRecord(impl.name, impl.role, **common) for impl in chosen]
    inputs = timing.case_inputs(runner, OP, dtype_name, records, too_big(shape, dtype_name, runner.device),
                                lambda: make_inputs(shape, dtype_name, runner.device))
    if inputs is None:
        return records
    runner.progress.step(f"{OP} {dtype_name} {products.shape} {PRODUCTS}")
    _measure_products(runner, products, inputs, timer)
    for impl, record in zip(chosen, records[1:]):
        runner.progress.step(f"{OP} {dtype_name} {record.shape} {impl.name}")
        record.note = runner.skip_reason(impl, OP, dtype_name)
        if not record.note:
            _measure(runner, impl, record, inputs, timer)
    for record in records:
        if record.ms is not None and products.ms:
            record.of_products = record.ms / products.ms
    del inputs
    timing.recover()
    return records


def _measure_products(runner, record: LinearLogProbsRecord, inputs: dict, timer: Callable) -> None:
    import torch

    step = None
    try:
        logits = torch.empty(inputs["x"].shape[0], inputs["w"].shape[0], dtype=inputs["x"].dtype,
                             device=runner.device)
        step = products_step(inputs["x"], inputs["w"], logits)
        record.ms = timer(step)
        record.extra_gib = peak_extra_gib(step, runner.device)
    except Exception as error:  # noqa: BLE001
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {record.impl}: {record.note}")
    logits = step = None
    timing.recover()


def _measure(runner, impl: Impl, record: LinearLogProbsRecord, inputs: dict, timer: Callable) -> None:
    """The time of the training step, then one more step whose peak memory is taken and whose outputs and
    gradients are compared with float64 (``errors``)."""
    x, w, target, g, c = (inputs[name] for name in ("x", "w", "target", "g", "c"))
    outputs = []
    try:
        f = impl.make(OP, inputs)
        record.ms = timer(training_step(f, x, w, g, c))
        x.grad = w.grad = None
        record.extra_gib = peak_extra_gib(lambda: outputs.append(_step_outputs(f, x, w, g, c)), runner.device)
        log_probs, entropy = outputs[0]
        (record.log_probs_error, record.entropy_error, record.grad_input_error,
         record.grad_weight_error) = errors(x, w, target, g, c, log_probs, entropy, x.grad, w.grad)
    except Exception as error:  # noqa: BLE001 - record it (out of memory, a failing kernel) and go on
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {impl.name}: {record.note}")
    x.grad = w.grad = None
    outputs.clear()
    timing.recover()


def _step_outputs(f: Callable, x, w, g, c) -> tuple:
    """One forward+backward of the objective: its log-probabilities and entropy, detached."""
    log_probs, entropy = f(x, w)
    ((log_probs * g).sum() + (entropy * c).sum()).backward()
    return log_probs.detach(), entropy.detach()
