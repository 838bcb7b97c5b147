"""Drop-in modules for ``torch.nn.Softmax``, ``torch.nn.LogSoftmax`` and ``torch.nn.CrossEntropyLoss``, and the
fused ``LinearCrossEntropyLoss``."""

from __future__ import annotations

import torch

from ._cross_entropy import cross_entropy
from ._loss_rules import legacy_reduction
from ._linear_cross_entropy import linear_cross_entropy
from ._softmax import log_softmax, softmax


class Softmax(torch.nn.Module):
    """``torch.nn.Softmax`` on multisoft's kernels: ``multisoft.softmax(input, dim)``.

    ``dim=None`` (the default, as torch's) is torch's deprecated implicit choice,
    with its warning: give ``dim``. ``backend`` picks the implementation for every
    call (None: the automatic choice, see ``multisoft.use_backend``).
    """

    def __init__(self, dim: int | None = None, *, backend: str | None = None):
        super().__init__()
        self.dim, self.backend = dim, backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return softmax(input, self.dim, _stacklevel=5, backend=self.backend)  # the frame torch's module names

    def extra_repr(self) -> str:
        return f"dim={self.dim}, backend={self.backend!r}"


class LogSoftmax(Softmax):
    """``torch.nn.LogSoftmax`` on multisoft's kernels: ``multisoft.log_softmax(input, dim)``; arguments as
    ``Softmax``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return log_softmax(input, self.dim, _stacklevel=5, backend=self.backend)


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` on multisoft's kernels: ``multisoft.cross_entropy(input, target, ...)``.

    The positional order is torch's (``weight, size_average, ignore_index,
    reduce, reduction, label_smoothing``; the two deprecated ones map to a
    ``reduction`` as torch maps them). ``weight`` is a buffer, so it follows
    ``.to(device)``. Keyword-only, as in ``multisoft.cross_entropy``:
    ``lse_square_scale`` (the z-loss), ``softcap``, ``return_lse`` (the module
    then returns ``(loss, lse)``), ``backend`` (the implementation for every
    call), ``inplace_backward`` (the forward overwrites the logits with their
    gradient) and ``process_group`` (vocabulary-parallel: the logits are this
    rank's slice of the classes, ``weight`` all of them; see
    ``multisoft.cross_entropy``).
    """

    def __init__(self, weight: torch.Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_lse: bool = False, backend: str | None = None, inplace_backward: bool = False,
                 process_group=None):
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = legacy_reduction(size_average, reduce)
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_lse = lse_square_scale, softcap, return_lse
        self.backend, self.inplace_backward, self.process_group = backend, inplace_backward, process_group

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
                             softcap=self.softcap, return_lse=self.return_lse, backend=self.backend,
                             inplace_backward=self.inplace_backward, process_group=self.process_group)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, return_lse={self.return_lse}, backend={self.backend!r}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of a language model's last layer without its logits: ``multisoft.linear_cross_entropy``.

    A criterion, like ``CrossEntropyLoss``: ``forward(input, linear_weight,
    target, linear_bias=None)`` takes the hidden states and the output layer's
    weight (and bias), so the model keeps owning its ``torch.nn.Linear`` (pass
    ``lm_head.weight``). torch's own ``torch.nn.LinearCrossEntropyLoss`` owns
    its Linear instead. The options are those of
    ``multisoft.linear_cross_entropy``; ``weight`` is a buffer, so it follows
    ``.to(device)``. With ``process_group`` (vocabulary-parallel) the
    ``linear_weight`` and ``linear_bias`` passed are this rank's rows of the
    output layer, ``weight`` all V classes', and ``input``'s gradient is
    summed over the group here (see ``multisoft.linear_cross_entropy``).
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_lse: bool = False, backend: str | None = None, chunk_size: int | None = None,
                 process_group=None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_lse = lse_square_scale, softcap, return_lse
        self.backend, self.chunk_size, self.process_group = backend, chunk_size, process_group

    def forward(self, input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                linear_bias: torch.Tensor | None = None):
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
                                    reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
                                    softcap=self.softcap, return_lse=self.return_lse, backend=self.backend,
                                    chunk_size=self.chunk_size, process_group=self.process_group)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, lse_square_scale={self.lse_square_scale}, "
                f"softcap={self.softcap}, return_lse={self.return_lse}, backend={self.backend!r}, "
                f"chunk_size={self.chunk_size}")
