"""Fused linear cross-entropy (``--ops linear_cross_entropy``): a training step's forward+backward of a mean loss
into the hidden states and the weight, per implementation, next to the three matrix products alone (the floor),
with its peak memory and its error against a float64 reference.

The implementations: each multisoft backend (``multisoft.linear_cross_entropy``), torch's ``F.linear`` then
``F.cross_entropy`` of float32 logits (what most models do), torch's own ``F.linear_cross_entropy`` where the
installed torch has it, Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` and Cut Cross-Entropy's
``linear_cross_entropy`` where they import. One case's inputs and reference are shared by all of them; a failure of
one (out of memory, an exception) is its record's note and the run goes on.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from . import plan, timing
from .impls import LIGER_PEER, TORCH_PEER, Impl
from .records import LinearRecord, describe_error

OP = "linear_cross_entropy"
SHAPES = [(8192, 4096, 32000), (16384, 4096, 151936), (8192, 4096, 262144)]  # (M tokens, H hidden, V vocabulary)
QUICK_SHAPES = [(4096, 4096, 32000)]
PRODUCTS = "products"
TORCH_FUSED_PEER = "torch-lce"
CCE_PEER = "cce"
REFERENCE_CHUNK_BYTES = 1 << 30  # float64 logits of one chunk of rows of the reference
ERROR_CHUNK_ROWS = 4096  # rows of a gradient compared in float64 at a time
TIMING = ("timing.long_call_ms: median of CUDA events over 3 to 10 calls (as many as fit in 1 s) after a warm-up "
          "call and a sizing call, L2 cleared before each call")


def shape_label(shape: tuple) -> str:
    return "x".join(str(size) for size in shape)


def cases(quick: bool) -> list[tuple]:
    return list(QUICK_SHAPES if quick else SHAPES)


def memory_needed(shape: tuple, dtype_name: str) -> int:
    """Bytes a case may hold at once, generously: its inputs and their gradients, the float64 reference (copies of
    both inputs, both gradients and a chunk of logits) and what the hungriest implementation adds, torch-native's
    logits in their dtype and three float32 arrays of their size (the logits, their log-softmax, its gradient)."""
    rows, hidden, classes = shape
    size = plan.ELEMENT_SIZE[dtype_name]
    inputs = (rows + classes) * hidden * size
    reference = 2 * (rows + classes) * hidden * 8 + REFERENCE_CHUNK_BYTES
    return 2 * inputs + reference + rows * classes * (size + 3 * 4)


def too_big(shape: tuple, dtype_name: str, device) -> str:
    """Why a case is skipped on ``device`` (it would not fit in the GPU's memory); "" when it is not."""
    return plan.memory_shortfall(memory_needed(shape, dtype_name), device)


# -- the implementations: make(op, inputs) gives f(x, w) -> the mean loss


def backend_impl(name: str) -> Impl:
    def make(op, inputs):
        import multisoft

        target = inputs["target"]
        return lambda x, w: multisoft.linear_cross_entropy(x, w, target, backend=name)
    return Impl(name, "backend", (OP,), make, directions=("forward+backward",))


def torch_native_peer() -> Impl:
    """``F.cross_entropy(F.linear(x, w).float(), target)``: the logits in full, upcast to float32."""
    def make(op, inputs):
        import torch.nn.functional as F

        target = inputs["target"]
        return lambda x, w: F.cross_entropy(F.linear(x, w).float(), target)
    return Impl(TORCH_PEER, "peer", (OP,), make, directions=("forward+backward",))


def torch_fused_peer() -> tuple[Impl | None, str]:
    """torch's ``F.linear_cross_entropy`` with its chunked path (``options=LinearCrossEntropyOptions()``), or
    None and why not."""
    import torch
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy"):
        return None, f"not in torch {torch.__version__}"
    options_class = getattr(torch.nn, "LinearCrossEntropyOptions", None)

    def make(op, inputs):
        target = inputs["target"]
        if options_class is None:
            return lambda x, w: F.linear_cross_entropy(x, w, target)
        options = options_class()
        return lambda x, w: F.linear_cross_entropy(x, w, target, options=options)
    how = "chunked: options=LinearCrossEntropyOptions()" if options_class else "its reference path (no options)"
    return Impl(TORCH_FUSED_PEER, "peer", (OP,), make, directions=("forward+backward",)), \
        f"torch {torch.__version__}, {how}"


def liger_peer() -> tuple[Impl | None, str]:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, called as ``loss(w, x, target)``, or None and why not."""
    try:
        version = importlib.metadata.version("liger-kernel")
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    except Exception as error:  # noqa: BLE001 - any import failure just leaves the peer out
        return None, f"not importable ({describe_error(error)})"

    def make(op, inputs):
        loss, target = LigerFusedLinearCrossEntropyLoss(), inputs["target"]
        return lambda x, w: loss(w, x, target)
    return Impl(LIGER_PEER, "peer", (OP,), make, directions=("forward+backward",)), version


def cce_peer() -> tuple[Impl | None, str]:
    """Cut Cross-Entropy's ``linear_cross_entropy(x, w, target)``, or None and why not."""
    try:
        version = importlib.metadata.version("cut-cross-entropy")
        from cut_cross_entropy import linear_cross_entropy
    except importlib.metadata.PackageNotFoundError:
        return None, "not installed"
    except Exception as error:  # noqa: BLE001
        return None, f"not importable ({describe_error(error)})"

    def make(op, inputs):
        target = inputs["target"]
        return lambda x, w: linear_cross_entropy(x, w, target)
    return Impl(CCE_PEER, "peer", (OP,), make, directions=("forward+backward",)), version


def choose_impls(backends: list[str], peers: bool) -> tuple[list[Impl], dict]:
    """Each backend, then (with ``peers``) torch-native and each fused peer that imports; and the environment's
    note of each fused peer."""
    chosen = [backend_impl(name) for name in backends]
    if not peers:
        return chosen, {}
    chosen.append(torch_native_peer())
    notes = {}
    for key, find in (("torch linear_cross_entropy", torch_fused_peer), ("liger fused linear cross-entropy",
                                                                         liger_peer), ("cut cross-entropy", cce_peer)):
        impl, notes[key] = find()
        if impl is not None:
            chosen.append(impl)
    return chosen, notes


# -- inputs, the float64 reference, the steps timed


def make_inputs(shape: tuple, dtype_name: str, device) -> dict:
    """x (M, H) and w (V, H) of ``dtype_name``, both requiring grad, w scaled by H**-0.5 so that the logits have
    about unit variance (as a trained model's do), and random class targets (M,)."""
    import torch

    rows, hidden, classes = shape
    dtype = getattr(torch, plan.DTYPES[dtype_name])
    x = torch.randn(rows, hidden, device=device, dtype=dtype).requires_grad_(True)
    w = torch.randn(classes, hidden, device=device, dtype=dtype).mul_(hidden ** -0.5).requires_grad_(True)
    return {"x": x, "w": w, "target": torch.randint(0, classes, (rows,), device=device)}


def reference(x, w, target) -> tuple[float, object, object]:
    """The mean loss and the gradients of x and w in float64, a chunk of rows at a time (a chunk's float64 logits
    at most REFERENCE_CHUNK_BYTES): the loss sums lse - logit[target]; each chunk's gradient of the logits,
    (softmax - onehot) / M, gives its rows of x's gradient and is accumulated into w's."""
    import torch

    rows, classes = x.shape[0], w.shape[0]
    x64, w64 = x.detach().double(), w.detach().double()
    grad_x, grad_w = torch.empty_like(x64), torch.zeros_like(w64)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    chunk = max(1, REFERENCE_CHUNK_BYTES // (classes * 8))
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        part, part_target = x64[start:stop], target[start:stop]
        logits = part @ w64.t()
        lse = torch.logsumexp(logits, 1)
        total += (lse - logits.gather(1, part_target[:, None])[:, 0]).sum()
        grad = logits.sub_(lse[:, None]).exp_()
        grad[torch.arange(stop - start, device=x.device), part_target] -= 1.0
        grad.div_(rows)
        torch.mm(grad, w64, out=grad_x[start:stop])
        grad_w.addmm_(grad.t(), part)
    return (total / rows).item(), grad_x, grad_w


def relative_error(value, expected) -> float:
    """max |value - expected| / max |expected|, a chunk of rows at a time (no float64 copy of all of value)."""
    worst = 0.0
    for start in range(0, expected.shape[0], ERROR_CHUNK_ROWS):
        stop = start + ERROR_CHUNK_ROWS
        worst = max(worst, (value[start:stop].double() - expected[start:stop]).abs_().max().item())
    scale = expected.abs().max().item()
    return worst / scale if scale else worst


def training_step(f: Callable, x, w) -> Callable:
    """One eager step: the gradients cleared (``.grad = None``, as ``zero_grad()`` does), ``f(x, w).backward()``."""
    def step():
        x.grad = None
        w.grad = None
        f(x, w).backward()
    return step


def products_step(x, w, g) -> Callable:
    """The three matrix products alone, the floor of any implementation: the logits ``x @ w.T`` (into ``g``),
    ``g @ w`` and ``g.T @ x`` (the two gradients, allocated as an implementation allocates them)."""
    import torch

    x, w = x.detach(), w.detach()

    def step():
        torch.mm(x, w.t(), out=g)
        torch.mm(g, w)
        torch.mm(g.t(), x)
    return step


def peak_extra_gib(step: Callable, device) -> float | None:
    """One call of ``step``: the peak memory allocated beyond what was allocated before it (None off a GPU)."""
    import torch

    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# -- a run


def run_cases(runner, chosen: list[Impl], shapes: list[tuple], dtypes: list[str],
              timer: Callable) -> list[LinearRecord]:
    """Every shape in every dtype: the products, then each of ``chosen``, each step timed by ``timer`` (fn -> ms);
    records with ``of_products`` set."""
    records = []
    for dtype_name in dtypes:
        for shape in shapes:
            records += run_case(runner, chosen, shape, dtype_name, timer)
    return records


def run_case(runner, chosen: list[Impl], shape: tuple, dtype_name: str, timer: Callable) -> list[LinearRecord]:
    """One case: its inputs and float64 reference, made once and shared; the products' record, then one per
    implementation (a case that does not fit, or whose inputs fail, gives every record the reason)."""
    rows, hidden, classes = shape
    size = plan.ELEMENT_SIZE[dtype_name]
    common = dict(dtype=dtype_name, shape=shape_label(shape), gradients_gib=(rows + classes) * hidden * size / 2**30,
                  logits_gib=rows * classes * size / 2**30)
    products = LinearRecord(PRODUCTS, "floor", **common)
    records = [products] + [LinearRecord(impl.name, impl.role, **common) for impl in chosen]

    def inputs_and_reference():
        inputs = make_inputs(shape, dtype_name, runner.device)
        return inputs, reference(inputs["x"], inputs["w"], inputs["target"])

    prepared = timing.case_inputs(runner, OP, dtype_name, records, too_big(shape, dtype_name, runner.device),
                                  inputs_and_reference)
    if prepared is None:
        return records
    inputs, expected = prepared
    runner.progress.step(f"{OP} {dtype_name} {products.shape} {PRODUCTS}")
    _measure_products(runner, products, inputs, timer)
    for impl, record in zip(chosen, records[1:]):
        runner.progress.step(f"{OP} {dtype_name} {record.shape} {impl.name}")
        record.note = runner.skip_reason(impl, OP, dtype_name)
        if not record.note:
            _measure(runner, impl, record, inputs, expected, timer)
    for record in records:
        if record.ms is not None and products.ms:
            record.of_products = record.ms / products.ms
    del inputs, expected
    timing.recover()
    return records


def _measure_products(runner, record: LinearRecord, inputs: dict, timer: Callable) -> None:
    import torch

    try:
        g = torch.empty(inputs["x"].shape[0], inputs["w"].shape[0], dtype=inputs["x"].dtype, device=runner.device)
        step = products_step(inputs["x"], inputs["w"], g)
        record.ms = timer(step)
        record.extra_gib = peak_extra_gib(step, runner.device)
    except Exception as error:  # noqa: BLE001
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {record.impl}: {record.note}")
    g = step = None
    timing.recover()


def _measure(runner, impl: Impl, record: LinearRecord, inputs: dict, expected: tuple, timer: Callable) -> None:
    """The time of the training step, then one more step whose peak memory is taken and whose loss and gradients
    are compared with the reference ``expected``."""
    x, w = inputs["x"], inputs["w"]
    loss = []
    try:
        f = impl.make(OP, inputs)
        record.ms = timer(training_step(f, x, w))
        x.grad = w.grad = None
        record.extra_gib = peak_extra_gib(lambda: loss.append(_backward(f(x, w))), runner.device)
        expected_loss, expected_grad_x, expected_grad_w = expected
        record.loss_error = abs(loss[0] - expected_loss) / abs(expected_loss)
        record.grad_input_error = relative_error(x.grad, expected_grad_x)
        record.grad_weight_error = relative_error(w.grad, expected_grad_w)
    except Exception as error:  # noqa: BLE001 - record it (out of memory, a failing kernel) and go on
        record.note = describe_error(error)
        runner.note(f"{OP} {record.dtype} {record.shape} {impl.name}: {record.note}")
    x.grad = w.grad = None
    timing.recover()


def _backward(loss) -> float:
    loss.backward()
    return float(loss.detach())
