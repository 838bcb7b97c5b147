"""``multisoft bench``: every op on every backend, against the copy bandwidth.

Times forward, backward and forward+backward of softmax, log_softmax and
blocksparse_softmax, and forward and forward+backward of cross_entropy (whose
forward computes the gradient and whose backward only scales it; also with
softcap and z-loss, in rows of their own), on each
backend that can run here (those selectable only by name, such as a float64
reference, are not timed), next to torch's own ops and Liger-Kernel's (when
importable), with CUDA events (median, L2 cleared between repetitions) twice:
the kernel time (the GPU's work, host time hidden) and the eager wall time
(triton.testing.do_bench, host time included: what an eager PyTorch user gets). Each result is given in GB/s and as
a fraction of a device-to-device copy measured in the same run. Also: peak
memory of cross-entropy forward+backward, the first (compiling) call of each
backend, and the host time a call of each implementation on a tiny tensor.
Asked for by name (``--ops linear_cross_entropy``): fused linear cross-entropy's
forward+backward against its three matrix products, with peak memory and
errors against float64, next to torch's, Liger-Kernel's and Cut
Cross-Entropy's. Asked for by name (``--ops train_step``, alias ``step``): a small
Llama's training step, eager and under torch.compile, with multisoft's loss against
the model's own. Writes CSV files, ``results.md`` and PNG plots.

Modules: ``plan`` (ops, shapes, layouts, bytes), ``timing`` (the timers),
``impls`` (what is compared), ``run`` (one run), ``host_time`` (the host time a
call), ``linear`` and ``linear_report`` (fused linear cross-entropy: its run
and its section of results.md), ``vocab_parallel`` and ``vocab_parallel_report``
(the same of vocabulary-parallel cross-entropy), ``train_step`` and
``train_step_report`` (the same of the training step), ``progress``, ``records``
(the CSV and JSON files), ``report`` (results.md, the targets), ``headline`` (its
headline summary and host time tables), ``cells`` (how a record reads in a
table), ``plots``, ``command`` (the command line).
"""

from .command import NO_GPU_MESSAGE, main

__all__ = ["NO_GPU_MESSAGE", "main"]
