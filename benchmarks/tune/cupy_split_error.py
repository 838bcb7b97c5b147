"""Where the CuPy split backward's float32 error sits on rows of a million columns, under two error models:
relative to |dx| and relative to the size of dx's terms (multisoft.check.softmax_backward_magnitude).

Rows as in tests/test_backend_cupy.py::test_softmax_split_rows_match_float64 (40 rows of 1073168 columns,
128 threads of 16 vectors; row 3 of -inf only and row 4 with a NaN, whose y is taken as 0). Prints, per row
kind, the largest error over each model's tolerance and the row's sum(dy).
"""
import sys

import torch

sys.path.insert(0, "tests")
from test_backend_cupy import TOLERANCES, max_ratio  # noqa: E402

from multisoft.check import softmax_backward_magnitude  # noqa: E402
from multisoft_cupy import _catalog, softmax  # noqa: E402

torch.manual_seed(0)
cfg = _catalog.SplitConfig(128, 16, 8192)  # 8192 float32 columns per block
_catalog.split_config = lambda *args: cfg
cols = 8192 * 131 + 16
x = torch.randn(40, cols, device="cuda").mul(4)
x[3] = float("-inf")
x[4, cols // 2] = float("nan")
dy = torch.randn_like(x)
for log in (False, True):
    ref = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
    y = torch.where(ref.isnan(), 0.0, ref).float()
    dx = torch.empty_like(x)
    softmax.backward(y, dy, dx, log)
    y64, dy64 = y.double(), dy.double()
    dot = dy64.sum(-1, True) if log else (y64 * dy64).sum(-1, True)
    ref_dx = dy64 - y64.exp() * dot if log else y64 * (dy64 - dot)
    magnitude = softmax_backward_magnitude(y, dy, -1, log)
    for name, rows in (("softmax rows", [r for r in range(40) if r not in (3, 4)]), ("y = 0 rows", [3, 4])):
        plain = max_ratio(dx[rows], ref_dx[rows], torch.float32)
        terms = max_ratio(dx[rows], ref_dx[rows], torch.float32, magnitude[rows])
        err = (dx[rows].double() - ref_dx[rows]).abs().max().item()
        print(f"log={log} {name}: max error {err:.3g}, / tolerance of |dx| {plain:.3g}, "
              f"of the terms {terms:.3g}; sum(dy) {[round(v, 1) for v in dot[rows, 0].tolist()[:4]]}")
print("tolerances", TOLERANCES[torch.float32])
