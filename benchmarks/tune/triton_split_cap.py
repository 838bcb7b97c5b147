"""Experiment: the Triton split softmax kernels capped at fewer registers (ptxas .maxnreg), so that more
programs fit on a multiprocessor while the rest of a chunk waits in local memory (L1) across the wait.

    capped(forward=48)   # the split forward compiled for at most 48 registers a thread

Patched over the kernels in multisoft_triton.softmax by benchmarks/tune/triton_split_cap.sh.
"""
import multisoft_triton.softmax as s


class _Capped:
    """A jitted kernel whose launches pass maxnreg."""

    def __init__(self, kernel, registers):
        self.kernel, self.registers = kernel, registers

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, maxnreg=self.registers, **kwargs)


def capped(forward=None, backward=None):
    """Statements' target: cap the split forward and/or backward kernels (None: leave as they are)."""
    if forward:
        s._fwd_split_kernel = _Capped(s._fwd_split_kernel, forward)
        s._fwd_split_stream_kernel = _Capped(s._fwd_split_stream_kernel, forward)
    if backward:
        s._bwd_split_kernel = _Capped(s._bwd_split_kernel, backward)
