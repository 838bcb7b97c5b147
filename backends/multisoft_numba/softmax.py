"""Row softmax / log_softmax, forward and backward: the way each shape's rows are walked, and the launch.

Three ways to walk a row, all reading in float32 and writing in the row's dtype:
- cached (_softmax_rows): the row held in registers (CACHE elements per thread): one read of the
  input. A thread block per row, or for short rows a group of threads per row, several rows a block
  (ROW_GROUP_MAX). The forward of 16-bit rows of 32768 (PREFETCH_FROM) runs as persistent blocks that
  read their next row while they reduce and write the current one.
- split (_softmax_split; GPU only, long rows): the row cut into parts (SPLIT_FORWARD, SPLIT_BWD), one
  block per part, each holding its part in registers; the parts exchange their statistics through
  global memory and wait for each other, so the input is still read once: a row's parts must be
  resident together (parts <= half the SMs, see _max_parts).
- looping (_softmax_rows; the rest, and the simulator, which runs one block at a time): one block per
  row, two reads (online max/sum, then the output), UNROLL loads in flight per thread. The second pass
  walks the row from its end, so it first meets what the first pass read last, while that is still in L2.

The cached and split paths hold 16-bit rows in vectors of 2 or more elements as their raw words
(_device.packed_io): two elements per register instead of one float each, so a block holds twice the
bytes. The settings named here are the tables of _tuning (docs/tuning.md), read at each call.
"""

from typing import NamedTuple

import numpy
import torch

from . import _tuning
from ._device import FP32
from ._launch import (MAX_THREADS, SIMULATOR, device_index, launch, multiprocessors, next_pow2, threads_for,
                      vector_views)
from ._softmax_rows import (backward_cached_kernel, backward_looping_kernel, backward_packed_kernel,
                            forward_cached_kernel, forward_looping_kernel, forward_packed_kernel,
                            forward_prefetch_kernel)
from ._softmax_split import (backward_split_kernel, backward_split_packed_kernel, forward_split_kernel,
                             forward_split_packed_kernel)
from ._tuning import COUNTER_STRIDE


def _max_parts(index: int, held: int) -> int:
    """Most parts a row may be split into on GPU `index`: few enough that they are always
    resident together (half the SMs, one block each), and at most MAX_PARTS[held]."""
    return min(_tuning.MAX_PARTS[held], multiprocessors(index) // 2)


class Plan(NamedTuple):
    """How a launch walks its rows: `path` ('cached' | 'prefetch' | 'split' | 'looping') with blocks of `threads`
    threads, each holding `cache` elements per thread (split, looping: the looping kernels' width is UNROLL), a row
    cut into `parts` blocks (split), its kernel compiled for `blocks` of them a multiprocessor (split; see
    SPLIT_FORWARD); `group` > 0 (cached only): a row per `group` threads, several rows a block; prefetch (forward,
    16-bit rows held as words): cached with a block a row, as persistent blocks."""

    path: str
    threads: int
    parts: int
    cache: int
    group: int = 0
    blocks: int = 0

    @property
    def bound(self):
        """The split kernel's launch bounds (None: the 1024-thread bound)."""
        return (self.threads, self.blocks) if self.blocks else None


def _plan(n: int, caches, splits, held: int, device=None, row_group_max: int = 0, wide=None) -> Plan:
    """The Plan for rows of n elements that take `held` bytes each in registers; `caches`: the elements
    per thread that a block holding the whole row may take, fewest first, each as a group of at most
    `row_group_max` threads sharing a block with other rows, else as a block; `splits`: the
    (threads, elements per thread, blocks a multiprocessor) of a block holding a part of a row, the first that
    makes at most SPLIT_FEW_PARTS parts, else the first whose parts can all be resident, else `wide` (the same),
    if its parts can."""
    for cache in caches:
        needed = next_pow2(-(-n // cache))
        if needed <= min(row_group_max, MAX_THREADS):
            return Plan("cached", min(_tuning.ROW_GROUP_BLOCK, MAX_THREADS), 1, cache, needed)
        threads = min(threads_for(n, cache), _tuning.CACHED_THREADS)
        if n <= threads * cache:
            return Plan("cached", threads, 1, cache)
    if not SIMULATOR and device is not None and device.type == "cuda":
        index = device_index(device)

        def fitting(choices):
            plans = [Plan("split", threads, -(-n // (threads * cache)), cache, 0, blocks)
                     for threads, cache, blocks in choices]
            return [p for p in plans if p.parts <= _max_parts(index, held)]

        regular = fitting(splits)
        if regular:
            return next((p for p in regular if p.parts <= _tuning.SPLIT_FEW_PARTS), regular[0])
        fallback = fitting((wide,)) if wide else []
        if fallback:
            return fallback[0]
    return Plan("looping", threads_for(n, 8 * _tuning.UNROLL), 1, splits[0][1])


def _forward_plan(n: int, held: int, device) -> Plan:
    plan = _plan(n, _tuning.CACHE[held], _tuning.SPLIT_FORWARD[held], held, device, _tuning.ROW_GROUP_MAX["forward"],
                 _tuning.SPLIT_WIDE["forward"][held])
    if plan.path == "cached" and not plan.group and held == 2 and n >= _tuning.PREFETCH_FROM.get(held, float("inf")):
        return plan._replace(path="prefetch")
    return plan


def _backward_plan(n: int, held: int, device) -> Plan:
    return _plan(n, _tuning.CACHE_BWD[held], _tuning.SPLIT_BWD[held], held, device, _tuning.ROW_GROUP_MAX["backward"],
                 _tuning.SPLIT_WIDE["backward"][held])


def _persistent_blocks(rows: int, device) -> int:
    """Blocks of a persistent launch: one a multiprocessor (the simulator: two, each walking several rows)."""
    if SIMULATOR or device.type != "cuda":
        return min(rows, 2)
    return min(rows, multiprocessors(device_index(device)))


def _cached_blocks(rows: int, threads: int, group: int) -> int:
    """Blocks of the cached kernels: a row each, or threads // group rows each."""
    return -(-rows // (threads // group)) if group else rows


def _held_bytes(fmt, width) -> int:
    """Bytes an element takes in registers: 2 for 16-bit rows read in pairs (held as words), else 4."""
    return 2 if _tuning.PACK_16BIT and fmt != FP32 and width >= 2 else 4


def _split_buffers(rows: int, parts: int, values_per_part: int, device):
    """(statistics, zeroed counters: started blocks, then published parts per row)."""
    stats = torch.empty(rows * parts * values_per_part, dtype=torch.float32, device=device)
    sync = torch.zeros((rows + 1) * COUNTER_STRIDE, dtype=torch.int32, device=device)
    return stats, sync


def forward(x, out, log: bool) -> None:
    rows, n = x.shape
    fmt, width, words = vector_views((x, out))
    held = _held_bytes(fmt, width)
    plan = _forward_plan(n, held, x.device)
    path, threads, parts, cache, group, _ = plan
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 2, x.device)
        build = forward_split_packed_kernel if held == 2 else forward_split_kernel
        launch(build(fmt, width, log, cache, plan.bound), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        build = forward_packed_kernel if held == 2 else forward_cached_kernel
        launch(build(fmt, width, log, cache, group), _cached_blocks(rows, threads, group), threads, words)
    elif path == "prefetch":
        launch(forward_prefetch_kernel(fmt, width, log, cache), _persistent_blocks(rows, x.device), threads, words)
    else:
        launch(forward_looping_kernel(fmt, width, log, _tuning.UNROLL), rows, threads, words)


def backward(y, dy, dx, log: bool) -> None:
    rows, n = y.shape
    fmt, width, words = vector_views((y, dy, dx))
    held = _held_bytes(fmt, width)
    plan = _backward_plan(n, held, y.device)
    path, threads, parts, cache, group, _ = plan
    log = bool(log)
    if path == "split":
        stats, sync = _split_buffers(rows, parts, 1, y.device)
        build = backward_split_packed_kernel if held == 2 else backward_split_kernel
        launch(build(fmt, width, log, cache, plan.bound), rows * parts, threads,
               (*words, stats, sync, numpy.int64(parts)))
    elif path == "cached":
        build = backward_packed_kernel if held == 2 else backward_cached_kernel
        launch(build(fmt, width, log, cache, group), _cached_blocks(rows, threads, group), threads, words)
    else:
        launch(backward_looping_kernel(fmt, width, log, _tuning.UNROLL), rows, threads, words)
