"""The rules every cross-entropy-like op shares: its options, their validation, target terms, gradient
coefficients, denominators, the reduction, and the errors.

The op modules (``_cross_entropy``, ``_linear_cross_entropy``) and the vocabulary-parallel module
(``vocab_parallel``) import what they share from here, and nothing from each other's private names; this module
imports no op.

``LossOptions`` is the one record of a loss's options: the public function validates them once
(``loss_options``) and passes the record through its layers and to the backends' kernels as one value; only a
``torch.library`` op's signature takes them field by field (``LossOptions(*fields)`` rebuilds the record inside).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from . import _validate
from ._registry import get_backend

REDUCTIONS = ("none", "mean", "sum")
_CACHED_VALUES_LIMIT = 64
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


class LossOptions(NamedTuple):
    """The options of a cross-entropy-like loss, as ``multisoft.cross_entropy`` takes them, validated: what the
    front passes to a backend's cross-entropy kernels as ``options`` (``backends/README.md``).

    ``ignore_index``: rows whose class-index target equals it have no loss and no gradient. ``reduction``:
    ``"none"``, ``"mean"`` or ``"sum"`` (the kernels write per-row losses; the front reduces them).
    ``label_smoothing`` in [0, 1]. ``softcap``: the logits are replaced by ``softcap * tanh(logits / softcap)``
    first; 0.0 means no cap (the public functions' ``None``). ``lse_square_scale`` (>= 0): the z-loss,
    ``lse_square_scale * lse**2`` added to every row's loss that is not ignored. ``temperature`` (finite, > 0):
    the (capped) logits are divided by it (softcap first, then temperature, as a model and then its sampler apply
    them); only ``multisoft.log_probs`` and ``multisoft.linear_log_probs`` take it so far.

    A new option is a new field with a default that changes nothing, its check in ``loss_options``, the kernels
    that use it, and its tests (CONTRIBUTING.md, "Adding a loss option")."""
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float = 0.0
    lse_square_scale: float = 0.0
    temperature: float = 1.0


def loss_options(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature=1.0) -> LossOptions:
    """The public functions' loss options, checked (each error names its argument), as a ``LossOptions``:
    ``softcap`` None becomes 0.0, the numbers floats. Under ``torch.compile`` they may be symbolic
    (``_validate``'s module docstring)."""
    if not _INT64_MIN <= _validate.integer(ignore_index, "ignore_index") <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64 (a class index), got {ignore_index}")
    _validate.one_of(reduction, REDUCTIONS, "reduction")
    label_smoothing = _validate.real(label_smoothing, "label_smoothing")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {float(label_smoothing)}")
    lse_square_scale = _validate.finite(lse_square_scale, "lse_square_scale")
    if lse_square_scale < 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {float(lse_square_scale)}")
    if softcap is None:
        softcap = 0.0
    else:
        softcap = _validate.real(softcap, "softcap")
        if not 0.0 < softcap < _validate.INF:  # not math.isfinite: dynamo cannot call it on a symbolic float
            raise ValueError(f"softcap must be a finite number > 0, or None for no cap; got {float(softcap)}")
    temperature = _validate.real(temperature, "temperature")
    if not 0.0 < temperature < _validate.INF:
        raise ValueError(f"temperature must be a finite number > 0, got {float(temperature)}")
    return LossOptions(ignore_index, reduction, label_smoothing, softcap, lse_square_scale, temperature)


def legacy_reduction(size_average, reduce) -> str:
    """torch's deprecated ``size_average``/``reduce`` pair (each None or a bool) as a ``reduction``, as torch maps
    them, with a deprecation warning pointing at the caller of the function that calls this one."""
    for name, value in (("size_average", size_average), ("reduce", reduce)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None (deprecated: use reduction=), got {type(value).__name__}")
    warnings.warn("size_average and reduce are deprecated, as in torch: use reduction='none'|'mean'|'sum'",
                  stacklevel=3)
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


# -- tensors: shapes, dtypes and devices


def check_logits_and_target(logits, target) -> tuple[int, bool]:
    """(the number of classes, whether ``target`` holds class probabilities) of logits (C,), (N, C) or
    (N, C, d1, ...) and a target of class indices (their shape without C) or of class probabilities (their
    shape); errors name the logits ``input``, the public name."""
    _validate.floating(logits, "input")
    _validate.tensor(target, "target")
    if logits.ndim == 0:
        raise ValueError("input must have shape (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    classes = logits.shape[1] if logits.ndim >= 2 else logits.shape[0]
    probabilities = target.is_floating_point()
    if probabilities:
        if target.shape != logits.shape:
            raise ValueError(f"target of class probabilities must have the input's shape {tuple(logits.shape)}, "
                             f"got {tuple(target.shape)}")
    else:
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"target must hold class indices as int64 or int32, or class probabilities of a "
                            f"floating dtype, got {target.dtype}")
        expected = logits.shape[:1] + logits.shape[2:] if logits.ndim >= 2 else torch.Size()
        if target.shape != expected:
            raise ValueError(f"target must have shape {tuple(expected)} for input of shape "
                             f"{tuple(logits.shape)}, got {tuple(target.shape)}")
    return classes, probabilities


def check_classes(classes, logits, target) -> None:
    """Rows to predict need classes to predict them from (errors name the logits ``input``, the public name)."""
    if classes == 0 and target.numel() > 0:
        raise ValueError(f"input has no classes (shape {tuple(logits.shape)}): there is nothing to predict from")


def check_weight(weight, classes, logits, differentiable=False) -> None:
    """``weight``: None, or one floating value per class on the logits' device; one that requires grad only where
    the loss is ``differentiable`` in it (class-probability targets, as with torch: its class-index loss is not
    differentiable in the weights either), rather than its gradient silently left out."""
    if weight is not None:
        _validate.floating(weight, "weight")
        if weight.shape != (classes,):
            raise ValueError(f"weight must have shape ({classes},), one per class, got {tuple(weight.shape)}")
        _validate.same_device(logits, "input", weight=weight)
        if weight.requires_grad and torch.is_grad_enabled() and not differentiable:
            raise ValueError("weight requires grad, but cross-entropy over class indices is not differentiable in "
                             "its class weights (nor is torch's): pass weight.detach()")


def check_targets_in_bounds(target, classes, ignore_index) -> None:
    """As torch: ``IndexError`` for a class-index target outside [0, classes) that is not ``ignore_index``, where
    the targets are on the CPU (reading them there costs no synchronisation). On a GPU the check would make the
    host wait for the device: such a row's loss and gradient are NaN instead, read in bounds."""
    if target.device.type != "cpu":
        return
    out_of_bounds = ((target < 0) | (target >= classes)) & (target != ignore_index)
    if out_of_bounds.any():
        raise IndexError(f"Target {int(target[out_of_bounds][0])} is out of bounds.")


def index_targets(target, ignore_index):
    """Class-index targets as the kernels take them, contiguous (rows,): int32 ones as int64 where
    ``ignore_index`` lies outside int32 (compared in int32 it would wrap around and match a target it is not)."""
    flat = target.reshape(-1)
    if flat.dtype == torch.int32 and not _INT32_MIN <= ignore_index <= _INT32_MAX:
        return flat.long()
    return flat.contiguous()


def class_last(tensor):
    """A (C,), (N, C) or (N, C, d1, ...) tensor as contiguous (rows, C)."""
    if tensor.ndim == 2:
        return tensor.contiguous()
    if tensor.ndim == 1:
        return tensor.unsqueeze(0)
    return tensor.movedim(1, -1).reshape(-1, tensor.shape[1]).contiguous()


def as_rows(logits, target, ignore_index):
    """(logits as contiguous (rows, C), targets as ``index_targets`` gives them, or (rows, C) for class
    probabilities): the class dimension moved last."""
    if target.is_floating_point():
        return class_last(logits), class_last(target)
    return class_last(logits), index_targets(target, ignore_index)


def kernel_inputs(logits, target, weight, ignore_index):
    """(logits as contiguous (rows, C), the targets as ``as_rows`` gives them, ``weight`` as the kernels take it
    (the statistics' dtype, contiguous) or None, the statistics' dtype)."""
    dtype = stats_dtype(logits.dtype)
    rows_2d, flat_target = as_rows(logits, target, ignore_index)
    if weight is not None:
        weight = weight.to(dtype).contiguous()
    return rows_2d, flat_target, weight, dtype


def shaped_result(loss, lse, logits, reduction: str, return_lse: bool):
    """The loss (per row of the target's shape for ``"none"``), and with ``return_lse`` the lse of that shape too,
    from the kernels' (rows,) of logits (C,), (N, C) or (N, C, d1, ...)."""
    if logits.ndim != 2:
        row_shape = logits.shape[:1] + logits.shape[2:] if logits.ndim > 2 else torch.Size()
        if reduction == "none":
            loss = loss.reshape(row_shape)
        if return_lse:
            lse = lse.reshape(row_shape)
    return (loss, lse) if return_lse else loss


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (or of a subclass), from its classes' names: without importing
    torch.distributed.tensor, and without reading ``sys.modules``, which torch.compile would trace as a dict that
    another thread's import can change while it is read. A plain tensor or a Parameter (of any Parameter class:
    a DTensor made a Parameter keeps its DTensor class) is answered first, without the classes' ``__mro__``, which
    torch.compile (torch 2.13) cannot iterate for a Parameter."""
    cls = type(tensor)
    if cls is torch.Tensor or issubclass(cls, torch.nn.Parameter):
        return False
    return any(base.__name__ == "DTensor" and base.__module__ == "torch.distributed.tensor" for base in cls.__mro__)


def refuse_inplace_on_a_leaf(logits) -> None:
    """``inplace_backward=True`` overwrites the logits with their gradient: refused, as torch refuses an in-place
    op, where autograd records the call and the logits are a leaf that requires grad (an ``nn.Parameter``, whose
    values the optimizer would then step from) or a view of one. A copy made for non-contiguous logits would
    spare them, but the rule does not depend on the layout."""
    if not (isinstance(logits, torch.Tensor) and logits.requires_grad and torch.is_grad_enabled()):
        return
    base = logits if logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf tensor that requires grad" if base is logits else "a view of a leaf tensor that requires grad"
        raise ValueError(f"inplace_backward=True would overwrite the logits, {what} (such as an nn.Parameter), "
                         f"with their gradient, as torch refuses an in-place op there: pass logits computed by "
                         f"the model (not a leaf), or inplace_backward=False")


# -- the loss and its gradient


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-row losses, log-sum-exps and every loss returned: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


_broadcast_values: dict[tuple, torch.Tensor] = {}


def broadcast_value(rows: int, dtype: torch.dtype, device: torch.device, value: float = 1.0) -> torch.Tensor:
    """A (rows,) view at stride 0 of one cached ``value`` (no allocation per call): sum's and none's grad_scale
    (1), or a mean's over class-probability targets (1 / rows). Not cached when first asked for while a CUDA
    graph is being captured (the fill would not have run)."""
    key = (rows, dtype, device, value)
    broadcast = _broadcast_values.get(key)
    if broadcast is None:
        with torch.inference_mode(False):
            broadcast = torch.full((1,), value, dtype=dtype, device=device).expand(rows)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return broadcast
        if len(_broadcast_values) >= _CACHED_VALUES_LIMIT:
            _broadcast_values.clear()
        _broadcast_values[key] = broadcast
    return broadcast


def denominator(target, weight, ignore_index, classes, dtype):
    """A mean's denominator, sum over the rows of w[target] (1 without weights), 0 for an ignored row: from the
    targets alone, so that the forward can fold 1 / denominator into the gradient it writes. An out-of-range
    target adds a weight in bounds (its loss is NaN anyway). Weights that sum to 0 give NaN, so that the mean is
    NaN as torch's is (its weighted mean is 0 / 0 there, even where label smoothing or the z-loss add to the
    sum); without weights a sum of 0 means every row is ignored, and the losses' sum is 0 too."""
    counted = target != ignore_index
    if weight is None:
        return counted.sum(dtype=dtype)
    total = torch.where(counted, weight[target.clamp(0, classes - 1)], 0.0).sum()
    return torch.where(total != 0, total, float("nan"))


def reduce_rows(loss_rows, reduction: str, denominator=None):
    """The per-row losses reduced: as they are (``"none"``), their sum, or their sum over ``denominator`` (a
    mean: the targets' weights' sum, the number of rows for class probabilities; an empty mean is 0 / 0, NaN, as
    torch's)."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return torch.div(loss_rows.sum(), denominator)


def empty_rows(rows_2d, reduction, dtype):
    """(loss, lse) of logits with no rows, from torch ops: torch's loss (an empty tensor, 0, or NaN for a mean),
    part of autograd as torch's would be."""
    per_row = rows_2d.sum(-1).to(dtype)
    return reduce_rows(per_row, reduction, 0.0), per_row


class TargetTerms(NamedTuple):
    """What a row's loss and gradient take from its class-index target, over all the classes."""
    ignored: torch.Tensor   # (M,) bool: target == ignore_index
    valid: torch.Tensor     # (M,) bool: target in [0, classes)
    keep: object            # (1 - eps) * w[target]: (M,), or the float 1 - eps without weights
    weight_sum: object      # sum of the class weights: 0-d, or the float number of classes without weights


def target_terms(target, weight, classes, options: LossOptions) -> TargetTerms:
    """The rows' TargetTerms; an invalid target reads a weight in bounds (its row is NaN anyway)."""
    keep = 1.0 - options.label_smoothing
    if weight is not None:
        keep = keep * weight[target.clamp(0, classes - 1)]
    weight_sum = weight.sum() if weight is not None else float(classes)
    return TargetTerms(target == options.ignore_index, (target >= 0) & (target < classes), keep, weight_sum)


def gradient_coefficients(terms: TargetTerms, lse, grad_scale, classes, options: LossOptions):
    """(3, M) coefficients a, b, c of each row's loss gradient du/dx * (a * p - b * [j == t] - c * w_j), times
    ``grad_scale`` (0-d or (M,)): a = (1 - eps) * w_t + eps / C * W + 2 * s * lse, b = (1 - eps) * w_t,
    c = eps / C. NaN for a target outside the classes, 0 for an ignored row."""
    per_class = options.label_smoothing / classes
    grad_scale = torch.where(terms.valid, grad_scale, float("nan"))
    at_target = at_all = grad_scale * terms.keep
    if options.label_smoothing:  # only then: 0 * W is NaN for an infinite class weight
        at_all = at_all + grad_scale * (per_class * terms.weight_sum)
    if options.lse_square_scale:
        at_all = at_all + grad_scale * (2.0 * options.lse_square_scale * lse)
    return torch.where(terms.ignored, 0.0, torch.stack((at_all, at_target, grad_scale * per_class)))


def folds_mean(dtype: torch.dtype) -> bool:
    """Whether a mean's 1 / denominator is folded into the gradient the forward writes (and the backward then
    costs nothing for ``loss.backward()``). Not for float16: a mean's gradient over N rows is the row gradient
    over N, which float16 (smallest normal 6e-5) rounds to 0 for small probabilities before a loss scale
    (``torch.amp.GradScaler``) multiplies it back in the backward; so float16 keeps the row gradient and the
    backward multiplies it by the incoming gradient over the denominator, as torch's own backward computes it."""
    return dtype != torch.float16


def backward_scale(denominator):
    """What the backward multiplies the incoming gradient by where a mean's 1 / denominator was not folded into
    the gradient: that, or 0 where the denominator is 0 (every row ignored: the kernels wrote 0, and torch's
    gradient is 0). NaN weights' sums stay NaN."""
    return torch.where(denominator != 0, denominator.reciprocal(), 0.0)


def scale_by_incoming(grad_logits, grad, backend):
    """grad_logits *= the incoming gradient of the loss, by the backend's ``scale``: one value for a reduced
    loss, or where every row's is the same (a stride-0 broadcast, as ``loss.sum().backward()`` gives), else one
    per row."""
    if grad.ndim == 0:
        factor = grad.reshape(1)
    elif not any(grad.stride()):
        factor = grad.reshape(-1)[:1]
    else:
        factor = grad.reshape(-1).contiguous()
    get_backend(backend).kernels("cross_entropy").scale(grad_logits, factor)
    return grad_logits


def softcap_derivative_(u, softcap):
    """du/dx = 1 - (u / softcap)**2 of capped logits ``u``, computed in place of ``u``."""
    return u.div_(softcap).square_().neg_().add_(1.0)


def lse_gradient(logits, grad_lse, softcap):
    """d (sum_i grad_lse[i] * lse_i) / d logits over whole rows, in float32 (float64 for float64 logits) torch
    ops: grad_lse[i] * p * du/dx, p the softmax of the capped logits u."""
    x = logits.to(stats_dtype(logits.dtype))
    if softcap:
        u = torch.tanh(x / softcap).mul_(softcap)
        return torch.softmax(u, -1).mul_(softcap_derivative_(u, softcap)).mul_(grad_lse.unsqueeze(1))
    return torch.softmax(x, -1).mul_(grad_lse.unsqueeze(1))


def add_lse_gradient(grad_logits, logits, grad_lse, softcap):
    """The loss's gradient plus the lse's: added into the loss's buffer (computed in float32, rounded once)."""
    part = lse_gradient(logits, grad_lse.reshape(-1), softcap)
    if grad_logits is None:
        return part.to(logits.dtype)
    return grad_logits.add_(part)


# -- per-token log-probabilities: from the whole rows' statistics (m, S, E) to the outputs, and the incoming
# gradients as the backward's kernel takes them


def scaled_logits(x, options: LossOptions):
    """u of logits ``x`` (in the statistics' dtype): softcap first, then temperature, as the kernels compute it."""
    if options.softcap:
        x = torch.tanh(x / options.softcap) * options.softcap
    return x / options.temperature


def log_probs_outputs(row_stats, picked, ids, classes, options: LossOptions):
    """(log-probabilities (rows, K), entropy (rows,)) from the whole rows' (3, rows) statistics (max m of u, sum S
    of exp(u - m), E = sum p (u - m)) and ``picked``, u at the (rows, K) ``ids``: u_t - m - log S (m apart from
    log S, as the kernels keep them) and log S - E; 0 at an id equal to ``ignore_index``, NaN at an id outside
    the ``classes`` and throughout a row whose max is infinite or NaN (as torch's ``log_softmax`` there)."""
    row_max, row_sum, spread = row_stats
    log_sum = row_sum.log()
    valid = (ids >= 0) & (ids < classes)
    finite_row = row_max.abs() != float("inf")
    log_probs = (picked - row_max.unsqueeze(1)) - log_sum.unsqueeze(1)
    log_probs = torch.where(ids == options.ignore_index, 0.0,
                            torch.where(valid & finite_row.unsqueeze(1), log_probs, float("nan")))
    return log_probs, torch.where(finite_row, log_sum - spread, float("nan"))


def log_probs_coefficients(ids, grad_log_probs, grad_entropy, classes, options: LossOptions, dtype):
    """(the incoming gradient of each id (rows, K), the (2, rows) coefficients (sum of those, the entropy's
    incoming gradient)) as ``log_probs.backward`` takes them, either incoming gradient None for none: 0 at an id
    equal to ``ignore_index``, NaN at an id outside the ``classes`` (its row's gradient is then NaN)."""
    rows, device = ids.shape[0], ids.device
    grad_ids = torch.zeros(ids.shape, dtype=dtype, device=device) if grad_log_probs is None else \
        grad_log_probs.to(dtype)
    valid = (ids >= 0) & (ids < classes)
    grad_ids = torch.where(ids == options.ignore_index, 0.0, torch.where(valid, grad_ids, float("nan")))
    entropy_part = torch.zeros(rows, dtype=dtype, device=device) if grad_entropy is None else \
        grad_entropy.reshape(rows).to(dtype)
    return grad_ids.contiguous(), torch.stack((grad_ids.sum(1), entropy_part))


# -- the errors of a gradient computed in the forward


def second_backward_error(op: str) -> RuntimeError:
    return RuntimeError(f"multisoft.{op} computes its gradient in the forward and hands it out in the first "
                        f"backward: a second backward through the same graph is not possible (compute the loss "
                        f"again)")


def double_backward_error(op: str) -> RuntimeError:
    return RuntimeError(f"multisoft.{op} does not support double backward (create_graph=True): its gradient is "
                        f"computed by a kernel from logits that are not kept")


def inplace_lse_error(op: str) -> RuntimeError:
    return RuntimeError(f"multisoft.{op} with inplace_backward=True cannot differentiate the returned lse: the "
                        f"forward overwrote the logits with the loss's gradient")


_eager_call = None


def run_eagerly(function, *arguments):
    """``function(*arguments)``, eager under torch.compile (a graph break: collectives and autograd.Functions that
    are not traced). ``torch.compiler.disable`` imports torch._dynamo, and with it Triton, so the wrapper is made
    the first time it is needed (a process group used), not when multisoft is imported."""
    global _eager_call
    if _eager_call is None:
        _eager_call = torch.compiler.disable(_call)
    return _eager_call(function, *arguments)


def _call(function, *arguments):
    return function(*arguments)
