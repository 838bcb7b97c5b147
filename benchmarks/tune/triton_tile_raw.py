"""Experiment: the Triton softmax forward tile of 16-bit rows held as loaded, with a register cap.

A bf16 row of 32768 takes a 32-warp program whose 48 registers a thread leave room for one program per
multiprocessor, so its loads and stores do not overlap another's. Held as loaded (one register per two
values) and capped at `maxnreg` registers (32: two such programs per multiprocessor), they could. Each
pass after the max widens the values through its own run-time zero (utils.widen_again), so the compiler
cannot keep the first pass's floats in place of the 16-bit values.
Patched over multisoft_triton.softmax.forward by benchmarks/tune/triton_tile_raw.sh.
"""
import torch
import triton
import triton.language as tl

import multisoft_triton.softmax as s
from multisoft_triton.utils import fast_exp, on_device, widen_again


@triton.jit
def _fwd_tile_raw_kernel(x_ptr, out_ptr, M, N, zero_sum, zero_out, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         LOG: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=-float("inf"))
    row_max = tl.max(x.to(tl.float32), axis=1)[:, None]
    total = tl.sum(fast_exp(widen_again(x, zero_sum) - row_max), axis=1)[:, None]
    shifted = widen_again(x, zero_out) - row_max
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = fast_exp(shifted) * (1.0 / total)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def tile_raw(maxnreg, warps=None, from_block=16384):
    """forward with 16-bit tiles of at least `from_block` columns held as loaded, capped at maxnreg."""
    original = s.forward

    def forward(x, out, log):
        M, N = x.shape
        block = s.next_power_of_2(N)
        if x.element_size() != 2 or M == 0 or not from_block <= block <= s.FORWARD_TILE_MAX[2]:
            return original(x, out, log)
        rows = s._tile_rows(x, block)
        options = {} if maxnreg is None else {"maxnreg": maxnreg}
        with on_device(x):
            _fwd_tile_raw_kernel[(triton.cdiv(M, rows),)](x, out, M, N, 0, 0, ROWS=rows, BLOCK=block, LOG=log,
                                                          num_warps=warps or s.warps_for(rows * block), **options)
    return forward


def check():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for M, N in ((300, 32768), (77, 20000), (64, 16384)):
            x = (torch.randn(M, N, device="cuda") * 4).to(dtype)
            x[1] = float("-inf")
            x[2, ::3] = float("-inf")
            for log in (False, True):
                want = (torch.log_softmax if log else torch.softmax)(x.double(), dim=1)
                for maxnreg, warps in ((None, None), (32, None), (40, None), (32, 16)):
                    out = torch.empty_like(x)
                    tile_raw(maxnreg, warps)(x, out, log)
                    ok = torch.isfinite(want)
                    error = (out.double() - want)[ok].abs().max().item()
                    same_inf = torch.equal(torch.isneginf(out), torch.isneginf(want))
                    nan = torch.isnan(out).any().item() != torch.isnan(want).any().item()
                    print(f"tile raw maxnreg={maxnreg} warps={warps} {dtype} {M}x{N} log={log}: max error "
                          f"{error:.3g}, -inf where expected {same_inf}, NaN mismatch {nan}", flush=True)


if __name__ == "__main__":
    check()
