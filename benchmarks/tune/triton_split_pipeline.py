"""Experiments on the Triton split softmax forward (long rows): where its time goes, and a pipelined form.

Patched over multisoft_triton.softmax.forward by benchmarks/tune/triton_split_pipeline.sh:

- ``nowait(chunk, warps)``: the split kernel without the wait for the row's other chunks (each chunk
  normalised by its own statistics: wrong results, timing only): what the wait costs.
- ``pipelined(chunk, warps, per_sm)``: persistent programs, ``per_sm`` per multiprocessor, each taking
  chunks by ticket in a loop and holding two: it loads and publishes the statistics of the next chunk
  before it waits for the current chunk's row, so that the wait overlaps a load instead of idling.
"""
import torch
import triton
import triton.language as tl

import multisoft_triton.softmax as s
from multisoft_triton.utils import fast_exp, next_power_of_2, on_device, safe_shift, sm_count


@triton.jit
def _nowait_kernel(x_ptr, out_ptr, max_ptr, sum_ptr, count_ptr, N, chunks, CHUNK: tl.constexpr,
                   LOG: tl.constexpr):
    row, ticket, offsets, mask = s._claim_chunk(count_ptr, N, chunks, CHUNK, True)
    x = tl.load(x_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    local_max = tl.max(x, axis=0)
    total = tl.sum(fast_exp(x - safe_shift(local_max)), axis=0)
    tl.store(max_ptr + ticket, local_max)
    tl.store(sum_ptr + ticket, total)
    shifted = x - local_max
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = fast_exp(shifted) * (1.0 / total)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_and_publish(x_ptr, max_ptr, sum_ptr, count_ptr, ticket, N, chunks, tickets, CHUNK: tl.constexpr,
                      COUNTER_STRIDE: tl.constexpr):
    """Load chunk `ticket` (nothing past the last ticket) and publish its (max, sum of exp(x - max))."""
    row = ticket // chunks
    cols = (ticket % chunks) * CHUNK + tl.arange(0, CHUNK)
    valid = ticket < tickets
    x = tl.load(x_ptr + row * N + cols, mask=(cols < N) & valid, other=-float("inf")).to(tl.float32)
    local_max = tl.max(x, axis=0)
    if valid:
        tl.store(max_ptr + ticket, local_max)
        tl.store(sum_ptr + ticket, tl.sum(fast_exp(x - safe_shift(local_max)), axis=0))
    tl.debug_barrier()
    if valid:
        tl.atomic_add(count_ptr + (row + 1) * COUNTER_STRIDE, 1, sem="release")
    return x


@triton.jit
def _pipelined_kernel(x_ptr, out_ptr, max_ptr, sum_ptr, count_ptr, N, chunks, tickets, CHUNK: tl.constexpr,
                      CHUNKS_P2: tl.constexpr, LOG: tl.constexpr, COUNTER_STRIDE: tl.constexpr):
    ticket = tl.atomic_add(count_ptr, 1).to(tl.int64)
    x = _load_and_publish(x_ptr, max_ptr, sum_ptr, count_ptr, ticket, N, chunks, tickets, CHUNK, COUNTER_STRIDE)
    while ticket < tickets:
        next_ticket = tl.atomic_add(count_ptr, 1).to(tl.int64)
        next_x = _load_and_publish(x_ptr, max_ptr, sum_ptr, count_ptr, next_ticket, N, chunks, tickets, CHUNK,
                                   COUNTER_STRIDE)
        row = ticket // chunks
        counter = count_ptr + (row + 1) * COUNTER_STRIDE
        arrived = tl.atomic_add(counter, 0, sem="acquire")
        while arrived < chunks:
            arrived = tl.atomic_add(counter, 0, sem="acquire")
        tl.debug_barrier()
        parts = row * chunks + tl.arange(0, CHUNKS_P2)
        part_mask = tl.arange(0, CHUNKS_P2) < chunks
        part_max = tl.load(max_ptr + parts, mask=part_mask, other=-float("inf"), volatile=True)
        part_sum = tl.load(sum_ptr + parts, mask=part_mask, other=0.0, volatile=True)
        row_max = tl.max(part_max, axis=0)
        total = tl.sum(part_sum * fast_exp(part_max - safe_shift(row_max)), axis=0)
        cols = (ticket % chunks) * CHUNK + tl.arange(0, CHUNK)
        shifted = x - row_max
        if LOG:
            y = shifted - tl.log(total)
        else:
            y = fast_exp(shifted) * (1.0 / total)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket
        x = next_x


def nowait(chunk, warps):
    def forward(x, out, log):
        M, N = x.shape
        chunks = triton.cdiv(N, chunk)
        stats = torch.empty((2, M * chunks), device=x.device, dtype=torch.float32)
        with on_device(x):
            _nowait_kernel[(M * chunks,)](x, out, stats[0], stats[1], s._split_counters(x, M), N, chunks,
                                          CHUNK=chunk, LOG=log, num_warps=warps)
    return forward


def pipelined(chunk, warps, per_sm):
    def forward(x, out, log):
        M, N = x.shape
        chunks = triton.cdiv(N, chunk)
        tickets = M * chunks
        stats = torch.empty((2, tickets), device=x.device, dtype=torch.float32)
        grid = min(tickets, per_sm * sm_count(x))
        assert 2 * grid >= chunks, "too few programs for a row's chunks"
        with on_device(x):
            _pipelined_kernel[(grid,)](x, out, stats[0], stats[1], s._split_counters(x, M), N, chunks, tickets,
                                       CHUNK=chunk, CHUNKS_P2=next_power_of_2(chunks), LOG=log,
                                       COUNTER_STRIDE=s.SPLIT_COUNTER_STRIDE, num_warps=warps)
    return forward


def check():
    """Largest error of each pipelined configuration against float64 torch, on rows that end mid-chunk."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for M, N in ((300, 131075), (64, 262144), (1000, 32768), (3, 1048576)):
            x = (torch.randn(M, N, device="cuda") * 4).to(dtype)
            for log in (False, True):
                want = (torch.log_softmax if log else torch.softmax)(x.double(), dim=1)
                for chunk, warps, per_sm in ((4096, 4, 5), (4096, 8, 4), (2048, 4, 8), (8192, 8, 2)):
                    out = torch.empty_like(x)
                    pipelined(chunk, warps, per_sm)(x, out, log)
                    error = (out.double() - want).abs().max().item()
                    print(f"pipelined {chunk}/{warps}/{per_sm} {dtype} {M}x{N} log={log}: max error {error:.3g}",
                          flush=True)


if __name__ == "__main__":
    check()
