"""multisoft: softmax, cross-entropy and block-sparse softmax on GPUs, one API over several backends.

Backends (Triton, CuPy, numba-cuda, PyTorch) are chosen per call (``backend=``),
per block (``use_backend``), by ``$MULTISOFT_BACKEND``, or automatically; no
kernel framework is imported until a backend runs.
"""

from . import nn
from ._registry import BackendInfo, BackendUnavailableError, available_backends, backends, use_backend
from ._blocksparse import (
    BlockSparseLayout,
    BlockSparseLUT,
    blocksparse_from_dense,
    blocksparse_softmax,
    blocksparse_softmax_backward,
    blocksparse_to_dense,
)
from ._cross_entropy import cross_entropy
from ._linear_cross_entropy import linear_cross_entropy
from ._linear_log_probs import linear_log_probs
from ._log_probs import log_probs
from ._loss_rules import LossOptions
from ._softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "BackendUnavailableError",
    "BlockSparseLUT",
    "BlockSparseLayout",
    "LossOptions",
    "available_backends",
    "backends",
    "blocksparse_from_dense",
    "blocksparse_softmax",
    "blocksparse_softmax_backward",
    "blocksparse_to_dense",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_log_probs",
    "log_probs",
    "log_softmax",
    "nn",
    "softmax",
    "use_backend",
]
