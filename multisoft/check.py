"""``python -m multisoft check``: every op on every backend that can run here, against float64.

The float64 references and the per-dtype tolerances live here; the test suite
uses the same ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (atol, rtol) against a float64 reference computed from the same (rounded) inputs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-4, 2e-3),
    torch.bfloat16: (1e-3, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def error_ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                magnitude: torch.Tensor | None = None) -> tuple[float, float]:
    """(max |actual - expected|, max of that over atol + rtol * magnitude); equal infinities and NaNs match.

    ``magnitude`` defaults to |expected|. A result that is a difference of larger
    terms (a backward's ``dy - p * sum(dy)``) passes the terms' size instead: float
    arithmetic can only promise a relative error of the terms, not of what is
    left after they cancel.
    """
    atol, rtol = TOLERANCES[dtype]
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    m = e.abs() if magnitude is None else magnitude.detach().to("cpu", torch.float64)
    same = (torch.isnan(a) & torch.isnan(e)) | (a == e)
    error = torch.where(same, 0.0, (a - e).abs().nan_to_num(float("inf")))
    if error.numel() == 0:
        return 0.0, 0.0
    return error.max().item(), (error / (atol + rtol * m.nan_to_num(0.0))).max().item()


# -- float64 references


def reference_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    x64 = x.double()
    return torch.log_softmax(x64, dim) if log else torch.softmax(x64, dim)


def reference_softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The backward as a function of the forward's output, in float64 (gradcheck ties it to the derivative)."""
    return _softmax_backward_terms(y, dy, dim, log)[0]


def softmax_backward_magnitude(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The size of the terms whose difference the backward is (see ``error_ratio``)."""
    return _softmax_backward_terms(y, dy, dim, log)[1]


def _softmax_backward_terms(y, dy, dim, log):
    """(the backward in float64, the size of its terms). The row sum it carries is only known to within
    a rounding error that grows with what is summed (as its 2-norm, for sums taken in a tree), not with
    the sum, which can cancel to near 0: the carried term's size counts the larger of the two."""
    y64, dy64 = y.detach().double(), dy.detach().double()
    summed = dy64 if log else y64 * dy64
    total = summed.sum(dim, keepdim=True)
    size = torch.maximum(total.abs(), torch.linalg.vector_norm(summed, dim=dim, keepdim=True))
    if log:
        return dy64 - y64.exp() * total, dy64.abs() + y64.exp() * size
    return y64 * (dy64 - total), y64.abs() * (dy64.abs() + size)


def reference_slice_gradient(logits, target, weight, row_max_sum, coefficients, softcap=0.0):
    """The backends' ``gradient`` of a slice of each row's classes in float64, and its terms' size (the magnitude
    ``assert_close`` takes): ``du/dx * (a exp(u - m) / S - b [j == t] - c w_j)`` with ``(m, S) = row_max_sum`` as
    given (the whole rows'), ``(a, b, c) = coefficients``, and no target term for a target outside [0, C)."""
    x = logits.detach().double()
    classes = x.shape[1]
    u = softcap * torch.tanh(x / softcap) if softcap else x
    du = 1 - (u / softcap) ** 2 if softcap else torch.ones_like(u)
    m, total = row_max_sum.double()
    a, b, c = coefficients.double()
    w = torch.ones(classes, dtype=torch.float64, device=x.device) if weight is None else weight.double()
    is_target = (torch.arange(classes, device=x.device)[None, :] == target.long()[:, None]).double()
    terms = (a[:, None] * torch.exp(u - m[:, None]) / total[:, None], b[:, None] * is_target, c[:, None] * w)
    return du * (terms[0] - terms[1] - terms[2]), du.abs() * sum(term.abs() for term in terms)


def reference_cross_entropy(logits, target, *, weight=None, ignore_index=-100, reduction="mean",
                            label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_lse=False):
    """multisoft.cross_entropy in float64: ``F.cross_entropy`` of the capped logits
    ``softcap * tanh(logits / softcap)``, plus the z-loss ``lse_square_scale * lse**2`` of every row that is not
    ignored (every row of class-probability targets), reduced like the loss (a mean divides it by the same
    denominator: the sum of the targets' weights, or the number of rows for class probabilities). With
    ``return_lse`` also every row's logsumexp of the capped logits, of the target's shape. Differentiable."""
    x = logits.double()
    u = softcap * torch.tanh(x / softcap) if softcap else x
    class_dim = 1 if x.ndim >= 2 else 0
    lse = torch.logsumexp(u, class_dim)
    probabilities = target.is_floating_point()
    weight64 = None if weight is None else weight.double()
    target = target.double() if probabilities else target.long()
    kwargs = dict(weight=weight64, label_smoothing=label_smoothing)
    if not probabilities:
        kwargs["ignore_index"] = ignore_index
    loss = F.cross_entropy(u, target, reduction=reduction, **kwargs)
    if lse_square_scale:
        if probabilities:
            z, denominator = lse.square(), lse.numel()
        else:
            counted = target != ignore_index
            row_weight = weight64[target.clamp(0, u.shape[class_dim] - 1)] if weight is not None else 1.0
            z = torch.where(counted, lse.square(), 0.0)
            denominator = torch.where(counted, row_weight, 0.0).sum()
        z = lse_square_scale * z
        loss = loss + {"none": z, "sum": z.sum(), "mean": z.sum() / denominator}[reduction]
    return (loss, lse) if return_lse else loss


def reference_log_probs(logits, target, *, temperature=1.0, softcap=None, ignore_index=-100, return_entropy=False):
    """multisoft.log_probs in float64: ``log_softmax(u)`` gathered at ``target`` with ``u`` the logits capped
    (``softcap * tanh(logits / softcap)``), then divided by ``temperature``; the class dimension last. ``target`` of
    the logits' shape without it (one id a row) or with a trailing K (K ids a row); 0 where an id is
    ``ignore_index``. With ``return_entropy`` also each row's entropy ``-sum_j p_j log p_j`` of the same
    distribution, a -inf logit adding 0 (0 log 0 = 0) and no NaN to its gradient. Differentiable."""
    x = logits.double()
    capped = softcap * torch.tanh(x / softcap) if softcap else x
    u = capped / temperature
    log_p = torch.log_softmax(u, -1)
    ids = target.long()
    one_id = ids.ndim == x.ndim - 1
    if one_id:
        ids = ids.unsqueeze(-1)
    ignored = ids == ignore_index
    picked = torch.where(ignored, 0.0, log_p.gather(-1, torch.where(ignored, 0, ids)))
    if one_id:
        picked = picked.squeeze(-1)
    if not return_entropy:
        return picked
    finite_u = torch.where(u == float("-inf"), 0.0, u)  # p is 0 there: the term is 0, and so is its gradient
    entropy = torch.logsumexp(u, -1) - (log_p.exp() * finite_u).sum(-1)
    return picked, entropy


def reference_log_probs_gradient(logits, target, grad_log_probs=None, grad_entropy=None, **options):
    """(float64 d(sum g * log_probs + sum c * entropy)/d logits by autograd of ``reference_log_probs`` with
    ``options``, either incoming gradient None for none; the size of the terms it sums, the magnitude
    ``error_ratio`` takes: du/dx * (|g| at the ids + p * (sum |g| + |c| * (|log p| + entropy))))."""
    x = logits.detach().double().requires_grad_()
    picked, entropy = reference_log_probs(x, target, return_entropy=True, **options)
    total = x.new_zeros(())
    if grad_log_probs is not None:
        total = total + (picked * grad_log_probs.double()).sum()
    if grad_entropy is not None:
        total = total + (entropy * grad_entropy.double()).sum()
    (grad,) = torch.autograd.grad(total, x)
    softcap, temperature = options.get("softcap"), options.get("temperature", 1.0)
    capped = softcap * torch.tanh(x.detach() / softcap) if softcap else x.detach()
    derivative = (1 - (capped / softcap) ** 2 if softcap else torch.ones_like(capped)) / temperature
    log_p = torch.log_softmax(capped / temperature, -1)
    p = log_p.exp()
    size = torch.zeros_like(p)
    if grad_log_probs is not None:
        g = grad_log_probs.double().abs().reshape(*p.shape[:-1], -1)
        ids = target.long().reshape(g.shape)
        inside = (ids >= 0) & (ids < p.shape[-1])
        size = size + p * g.sum(-1, keepdim=True)
        size = size.scatter_add(-1, torch.where(inside, ids, 0), torch.where(inside, g, 0.0))
    if grad_entropy is not None:
        finite_log_p = torch.where(p > 0, log_p, 0.0).abs()
        size = size + p * grad_entropy.double().abs().unsqueeze(-1) * (finite_log_p + entropy.detach().unsqueeze(-1))
    return grad, derivative.abs() * size


def reference_linear_logits(input, linear_weight, linear_bias=None):
    """(float64 leaves of ``input``, ``linear_weight`` and ``linear_bias`` that require grad, the float64 logits
    (M, V) of ``F.linear`` of them, differentiable into them). 16-bit logits take the values that torch's
    ``F.linear`` gives in that dtype: that rounding, up to 2**-9 of each logit in bfloat16, belongs to the function
    (the op of the 16-bit logits), not to its implementation, and exp() would turn it into more than the dtype's
    tolerance once logits pass ~4."""
    given = (input, linear_weight, linear_bias)
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in given]
    logits = F.linear(*leaves).reshape(-1, linear_weight.shape[0])
    if input.dtype in (torch.float16, torch.bfloat16):
        rounded = F.linear(*(None if t is None else t.detach() for t in given))
        logits = logits + (rounded.double().reshape(logits.shape) - logits).detach()
    return leaves, logits


def reference_linear_cross_entropy(input, linear_weight, target, linear_bias=None, **options):
    """multisoft.linear_cross_entropy in float64: ``reference_cross_entropy`` of ``reference_linear_logits``.
    Returns (leaves, float64 logits (M, V), the reference's output)."""
    leaves, logits = reference_linear_logits(input, linear_weight, linear_bias)
    return leaves, logits, reference_cross_entropy(logits, target.reshape(-1), **options)


def linear_gradient_magnitudes(grad_logits, input, linear_weight):
    """The size of the terms each gradient of linear_cross_entropy sums (see ``error_ratio``), from the float64
    gradient of the logits (M, V): ``|dlogits| @ |W|`` for the input's, ``|dlogits|.T @ |input|`` for the weight's,
    ``|dlogits|.sum(0)`` for the bias's."""
    size = grad_logits.detach().double().abs()
    x = input.detach().double().reshape(-1, linear_weight.shape[1]).abs()
    return size @ linear_weight.detach().double().abs(), size.t() @ x, size.sum(0)


def reference_blocksparse(x, layout, block, scale, is_causal) -> torch.Tensor:
    """softmax(scale * x) in float64, each row over its unmasked elements (its stored blocks' elements, with
    is_causal those not past the diagonal) as dense torch.softmax gives it over them: NaN throughout for a NaN or
    +inf among them or when all are -inf. Masked elements 0; a row with no unmasked element zeros."""
    from ._blocksparse import blocksparse_from_dense, blocksparse_to_dense

    x64 = x.detach().double()
    scores = blocksparse_to_dense(x64 * scale, layout, block)
    unmasked = blocksparse_to_dense(torch.ones_like(x64), layout, block) > 0
    if is_causal:
        m, n = scores.shape[-2:]
        unmasked = unmasked & torch.ones(m, n, dtype=torch.bool, device=x.device).tril()
    # masked elements as -inf add nothing to a row that has an unmasked element; a row with none is all NaN here
    y = torch.softmax(scores.masked_fill(~unmasked, float("-inf")), -1).masked_fill(~unmasked, 0.0)
    return blocksparse_from_dense(y, layout, block)


def reference_blocksparse_backward(y, dy, layout, block, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = scale * y * (dy - rowsum(y * dy)) in float64, from the forward's output, 0 wherever y is 0 (masked
    elements, elements of probability 0, rows of zeros: also in a row whose sum is NaN); and its terms' size."""
    from ._blocksparse import blocksparse_from_dense, blocksparse_to_dense

    y64 = blocksparse_to_dense(y.detach().double(), layout, block)
    dy64 = blocksparse_to_dense(dy.detach().double(), layout, block)
    dx, magnitude = _softmax_backward_terms(y64, dy64, -1, False)
    dx = dx.masked_fill(y64 == 0, 0.0)
    return blocksparse_from_dense(scale * dx, layout, block), blocksparse_from_dense(abs(scale) * magnitude, layout,
                                                                                     block)


# -- the check command


@dataclass
class Row:
    op: str
    backend: str
    dtype: str
    shape: str
    max_error: float = 0.0
    ratio: float = 0.0          # worst error over tolerance, against float64
    peer_ratio: float = 0.0     # worst disagreement with the other backends, over twice the tolerance
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and self.ratio <= 1.0 and self.peer_ratio <= 1.0


def _cases(device: torch.device, small: bool):
    """(op name, shape label, function(backend, dtype) -> {output name: (value, float64 reference)})."""
    import multisoft

    soft_shapes = [(3, 100), (2, 5000)] if small else [(4, 1000), (64, 4096), (2, 131_072), (2, 262_144)]
    ce_shapes = [(8, 300)] if small else [(64, 32_000), (8, 128_256)]
    bs_cases = [(16, 2, 4)] if small else [(32, 4, 16), (128, 2, 8)]
    # (rows, hidden, classes, chunk_size): chunks that do not divide the rows
    lce_shapes = [(8, 16, 100, 3)] if small else [(1000, 256, 32_000, 384)]
    lp_shapes = [(6, 300, 2)] if small else [(64, 32_000, 1), (8, 151_936, 3)]

    def softmax_case(shape, log):
        def run(backend, dtype):
            gen = torch.Generator(device="cpu").manual_seed(1)
            x = (torch.randn(shape, generator=gen) * 3).to(device, dtype).requires_grad_()
            dy = torch.randn(shape, generator=gen).to(device, dtype)
            op = multisoft.log_softmax if log else multisoft.softmax
            y = op(x, -1, backend=backend)
            (dx,) = torch.autograd.grad(y, x, dy)
            return {"forward": (y, reference_softmax(x.detach(), -1, log), None),
                    "backward": (dx, reference_softmax_backward(y, dy, -1, log),
                                 softmax_backward_magnitude(y, dy, -1, log))}
        return run

    def ce_case(shape):
        def run(backend, dtype):
            gen = torch.Generator(device="cpu").manual_seed(2)
            m, c = shape
            logits = (torch.randn(shape, generator=gen) * 2).to(device, dtype).requires_grad_()
            target = torch.randint(0, c, (m,), generator=gen)
            target[::5] = -100
            target = target.to(device)
            weight = (torch.rand(c, generator=gen) + 0.5).to(device)
            kwargs = dict(weight=weight, label_smoothing=0.1, softcap=15.0, lse_square_scale=1e-3, return_lse=True)
            loss, lse = multisoft.cross_entropy(logits, target, backend=backend, **kwargs)
            (grad,) = torch.autograd.grad(loss, logits)
            logits64 = logits.detach().double().requires_grad_()
            expected, expected_lse = reference_cross_entropy(logits64, target, **kwargs)
            (expected_grad,) = torch.autograd.grad(expected, logits64)
            return {"forward": (loss, expected, None), "backward": (grad, expected_grad, None),
                    "lse": (lse, expected_lse, None)}
        return run

    def lce_case(rows, hidden, classes, chunk_size):
        def run(backend, dtype):
            gen = torch.Generator(device="cpu").manual_seed(4)
            x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_()
            # logits of order 3
            w = (torch.randn(classes, hidden, generator=gen) * (3 / hidden ** 0.5)).to(device, dtype).requires_grad_()
            b = torch.randn(classes, generator=gen).to(device, dtype).requires_grad_()
            target = torch.randint(0, classes, (rows,), generator=gen)
            target[::5] = -100
            target = target.to(device)
            weight = (torch.rand(classes, generator=gen) + 0.5).to(device)
            # a sum: gradients of order 1. A mean's are of order 1 / rows, below the atol of 16-bit dtypes at the
            # GPU's rows, and a float16 mean's forward rounds them before the backward's incoming gradient (a loss
            # scale) could restore them: a known shortfall of linear_cross_entropy, not what this case checks
            kwargs = dict(weight=weight, label_smoothing=0.1, softcap=15.0, lse_square_scale=1e-3, return_lse=True,
                          reduction="sum")
            loss, lse = multisoft.linear_cross_entropy(x, w, target, linear_bias=b, backend=backend,
                                                       chunk_size=chunk_size, **kwargs)
            grads = torch.autograd.grad(loss, (x, w, b))
            leaves, logits, (expected, expected_lse) = reference_linear_cross_entropy(x, w, target, b, **kwargs)
            *expected_grads, grad_logits = torch.autograd.grad(expected, (*leaves, logits))
            magnitudes = linear_gradient_magnitudes(grad_logits, x, w)
            results = {"forward": (loss, expected, None), "lse": (lse, expected_lse, None)}
            for name, *result in zip(("input", "weight", "bias"), grads, expected_grads, magnitudes):
                results[f"backward {name}"] = tuple(result)
            return results
        return run

    def lp_case(rows, classes, ids_a_row):
        def run(backend, dtype):
            gen = torch.Generator(device="cpu").manual_seed(5)
            logits = (torch.randn(rows, classes, generator=gen) * 3).to(device, dtype).requires_grad_()
            target = torch.randint(0, classes, (rows, ids_a_row), generator=gen)
            target[::5, 0] = -100
            target = target.to(device)
            grad_ids = torch.randn(rows, ids_a_row, generator=gen).to(device)
            grad_entropy = torch.randn(rows, generator=gen).to(device)
            kwargs = dict(temperature=0.7, softcap=20.0)
            picked, entropy = multisoft.log_probs(logits, target, return_entropy=True, backend=backend, **kwargs)
            (grad,) = torch.autograd.grad((picked, entropy), logits, (grad_ids, grad_entropy))
            expected_picked, expected_entropy = reference_log_probs(logits.detach(), target, return_entropy=True,
                                                                    **kwargs)
            expected_grad, magnitude = reference_log_probs_gradient(logits, target, grad_ids, grad_entropy, **kwargs)
            # each a difference of terms of the size of the lse (u_t - lse, lse - sum p u)
            size = torch.logsumexp(logits.detach().double() / 0.7, -1).abs().unsqueeze(-1) + 1.0
            return {"forward": (picked, expected_picked, expected_picked.abs() + size),
                    "entropy": (entropy, expected_entropy, expected_entropy.abs() + size.squeeze(-1)),
                    "backward": (grad, expected_grad, magnitude)}
        return run

    def bs_case(block, heads, block_rows):
        def run(backend, dtype):
            gen = torch.Generator(device="cpu").manual_seed(3)
            layout = (torch.rand(heads, block_rows, block_rows, generator=gen) < 0.5).long()
            layout[:, :, 0] = 1
            nnz = int(layout.sum())
            x = (torch.randn(2, nnz, block, block, generator=gen) * 2).to(device, dtype).requires_grad_()
            dy = torch.randn(2, nnz, block, block, generator=gen).to(device, dtype)
            y = multisoft.blocksparse_softmax(x, layout, block, scale=0.5, is_causal=True, backend=backend)
            (dx,) = torch.autograd.grad(y, x, dy)
            return {"forward": (y, reference_blocksparse(x.detach(), layout, block, 0.5, True), None),
                    "backward": (dx, *reference_blocksparse_backward(y, dy, layout, block, 0.5))}
        return run

    for shape, log in itertools.product(soft_shapes, (False, True)):
        yield ("log_softmax" if log else "softmax"), "x".join(map(str, shape)), softmax_case(shape, log)
    for shape in ce_shapes:
        yield "cross_entropy", "x".join(map(str, shape)), ce_case(shape)
    for rows, hidden, classes, chunk_size in lce_shapes:
        yield ("linear_cross_entropy", f"M{rows} H{hidden} V{classes} chunk {chunk_size}",
               lce_case(rows, hidden, classes, chunk_size))
    for rows, classes, ids_a_row in lp_shapes:
        yield "log_probs", f"{rows}x{classes} {ids_a_row} ids", lp_case(rows, classes, ids_a_row)
    for block, heads, block_rows in bs_cases:
        yield "blocksparse", f"b{block} h{heads} {block_rows}x{block_rows} causal", bs_case(block, heads, block_rows)


# The registry's op (the backend's kernel module) of each op that the check runs.
REGISTRY_OP = {"softmax": "softmax", "log_softmax": "softmax", "cross_entropy": "cross_entropy",
               "linear_cross_entropy": "cross_entropy", "blocksparse": "blocksparse", "log_probs": "log_probs"}


def run_check(device: torch.device, backends: list[str], small: bool) -> list[Row]:
    """The table's rows: every op of ``_cases`` on each of ``backends`` that implements it (a backend that does not
    is left out of that op's rows: the command says so), in each dtype."""
    from ._registry import get_backend

    rows = []
    for (op, shape, case), dtype in itertools.product(_cases(device, small), DTYPES):
        outputs = {}
        for backend in backends:
            if not get_backend(backend).supports(REGISTRY_OP[op]):
                continue
            try:
                outputs[backend] = case(backend, dtype)
            except Exception as error:  # a failing backend is a row of the table, not a crash
                rows.append(Row(f"{op}", backend, str(dtype).replace("torch.", ""), shape,
                                error=f"{type(error).__name__}: {error}"[:120]))
        for direction in dict.fromkeys(d for results in outputs.values() for d in results):
            for backend, results in outputs.items():
                value, expected, magnitude = results[direction]
                row = Row(f"{op} {direction}", backend, str(dtype).replace("torch.", ""), shape)
                row.max_error, row.ratio = error_ratio(value, expected, dtype, magnitude)
                for other, other_results in outputs.items():
                    if other != backend:
                        _, ratio = error_ratio(value, other_results[direction][0], dtype, magnitude)
                        row.peer_ratio = max(row.peer_ratio, ratio / 2)
                rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("op", "shape", "backend", "dtype", "max error", "err/tol", "vs peers", "result")
    lines = [header]
    for r in rows:
        lines.append((r.op, r.shape, r.backend, r.dtype, f"{r.max_error:.2e}", f"{r.ratio:.3f}",
                      f"{r.peer_ratio:.3f}", "pass" if r.passed else f"FAIL {r.error}".strip()))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)
