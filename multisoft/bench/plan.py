"""What the benchmark measures: the ops, dtypes and shapes, the block-sparse layouts, and the bytes each op moves."""

from __future__ import annotations

import dataclasses
import math

OPS = ("softmax", "log_softmax", "cross_entropy", "blocksparse_softmax")  # the default set
# Timed only when asked for (--ops): fused linear cross-entropy's cases take minutes (fp32 matmuls of M·H·V, a
# float64 reference each), more than the rest of a full run; vocabulary-parallel cross-entropy needs 2 GPUs; a small
# Llama's training step compiles the model for each loss; per-token log-probabilities (on logits, and fused with the
# output layer) have tables of their own, each with a float64 reference. Their cases and tables are in the linear,
# vocab_parallel, train_step, log_probs and linear_log_probs modules.
EXTRA_OPS = ("linear_cross_entropy", "vocab_parallel", "train_step", "log_probs", "linear_log_probs")
OP_ALIASES = {"blocksparse": "blocksparse_softmax", "ce": "cross_entropy", "lce": "linear_cross_entropy",
              "vp": "vocab_parallel", "step": "train_step", "lp": "log_probs", "llp": "linear_log_probs"}
KERNEL_MODULE = {"softmax": "softmax", "log_softmax": "softmax", "cross_entropy": "cross_entropy",
                 "blocksparse_softmax": "blocksparse", "linear_cross_entropy": "cross_entropy",
                 "vocab_parallel": "cross_entropy", "train_step": "cross_entropy", "log_probs": "log_probs",
                 "linear_log_probs": "log_probs"}
DIRECTIONS = ("forward", "backward", "forward+backward")
# The directions timed of each op. Cross-entropy has no backward of its own: its forward computes the gradient when
# the logits require grad and its backward only scales that (nothing at all when the incoming gradient is 1), and a
# second backward through one graph raises; forward+backward is what a training step pays.
OP_DIRECTIONS = {"softmax": DIRECTIONS, "log_softmax": DIRECTIONS, "blocksparse_softmax": DIRECTIONS,
                 "cross_entropy": ("forward", "forward+backward")}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}

# Bytes moved per input element: softmax reads x and writes y (2), its backward reads y, dy and
# writes dx (3); cross-entropy's forward reads the logits (1), its forward+backward reads them once and writes the
# gradient once (2: the two-pass floor, which a forward that writes the gradient, as Liger-Kernel's does, can reach).
TRAFFIC = {
    "softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "log_softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "blocksparse_softmax": {"forward": 2, "backward": 3, "forward+backward": 5},
    "cross_entropy": {"forward": 1, "forward+backward": 2},
}

HEADLINE = [(32768, 1024), (16384, 4096), (4096, 32768), (1024, 131072), (512, 262144)]
CROSS_ENTROPY = [(8192, 32000), (8192, 128256), (4096, 262144), (16384, 151936)]
SWEEP_ELEMENTS = 1 << 26
SWEEP_COLS = [1 << k for k in range(8, 21)]
HEADS, SEQ, SCALE = 16, 4096, 0.125
LAYOUTS = ([(block, 0.25, causal) for block in (16, 32, 64, 128) for causal in (False, True)]
           + [(64, density, causal) for density in (0.10, 0.50) for causal in (False, True)])

# The cells of the headline summary (op, dtype, shape) and what --headline times of them.
HEADLINE_CELLS = [("softmax", "fp32", (32768, 1024)), ("softmax", "bf16", (16384, 4096)),
                  ("cross_entropy", "bf16", (8192, 32000)), ("cross_entropy", "fp32", (8192, 32000))]
HEADLINE_DIRECTIONS = ("forward", "forward+backward")
SUMMARY_DIRECTION = "forward+backward"  # the direction the headline summary shows

QUICK_HEADLINE = [(16384, 4096), (1024, 131072)]
QUICK_SWEEP_COLS = [1024, 32768, 1 << 20]
QUICK_CROSS_ENTROPY = [(8192, 32000)]
QUICK_LAYOUTS = [(64, 0.25, False), (64, 0.25, True)]

# Cross-entropy with the options of LLM training: Gemma 2's logit softcap and PaLM's z-loss, each case labelled
# "<M>x<V> " + CROSS_ENTROPY_OPTIONS_LABEL, timed in its own dtypes (--quick: the first quick shape, every dtype).
# Their bytes are the plain cases' (the same two-pass floor); they are not held to the backends' targets.
CROSS_ENTROPY_OPTIONS = {"softcap": 30.0, "lse_square_scale": 1e-4}
CROSS_ENTROPY_OPTIONS_LABEL = "softcap=30 z=1e-4"
CROSS_ENTROPY_OPTION_CELLS = [((8192, 128256), ("bf16",)), ((8192, 32000), ("fp32",))]
OPTIONS_GROUP = "options"

COPY_BYTES = 1 << 30  # the long copy every result is a fraction of: 1 GiB read, 1 GiB written


@dataclasses.dataclass
class Case:
    """One input of one op: a dense (M, N) shape or a block-sparse layout."""

    op: str
    group: str  # "headline", "sweep", "headline,sweep", "layout" or OPTIONS_GROUP
    label: str
    shape: tuple
    elements: int
    n: int = 0
    layout: object = None  # block-sparse: the (H, Mb, Nb) layout tensor
    block: int = 0
    causal: bool = False
    dtypes: tuple = ()  # only these dtypes (of those asked for); empty: every one asked for
    options: dict = dataclasses.field(default_factory=dict)  # cross-entropy's keyword options, e.g. softcap


def bytes_moved(op: str, direction: str, elements: int, element_size: int) -> int:
    """The bytes an op must read and write for ``elements`` input elements (see TRAFFIC)."""
    return TRAFFIC[op][direction] * elements * element_size


def _factors(op: str) -> str:
    return ", ".join(f"{direction} {factor}" for direction, factor in TRAFFIC[op].items())


def bytes_counted() -> str:
    """How TRAFFIC counts the bytes, as results.md states it (a run records it with its results)."""
    return (f"softmax, log_softmax and block-sparse (over Z·nnz·block² elements): {_factors('softmax')} × "
            f"elements × element size; cross-entropy: {_factors('cross_entropy')} × M·V × element size (the "
            "logits read once, and for forward+backward the gradient written once)")


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def sweep_shapes(cols: list[int]) -> list[tuple[int, int]]:
    """(M, N) for each N with M * N = SWEEP_ELEMENTS (64M elements)."""
    return [(max(1, SWEEP_ELEMENTS // n), n) for n in cols]


def dense_cases(op: str, headline: list, sweep: list) -> list[Case]:
    """The headline shapes, then the sweep's other shapes; a shape in both is measured once."""
    cases = []
    for rows, cols in dict.fromkeys(headline + sweep):
        group = ",".join(name for name, shapes in (("headline", headline), ("sweep", sweep))
                         if (rows, cols) in shapes)
        cases.append(Case(op, group, f"{rows}x{cols}", (rows, cols), rows * cols, n=cols))
    return cases


def option_cases(cells: list) -> list[Case]:
    """Cross-entropy with CROSS_ENTROPY_OPTIONS: one case per ((M, V), dtypes) of ``cells``."""
    return [Case("cross_entropy", OPTIONS_GROUP, f"{rows}x{cols} {CROSS_ENTROPY_OPTIONS_LABEL}", (rows, cols),
                 rows * cols, n=cols, dtypes=dtypes, options=dict(CROSS_ENTROPY_OPTIONS))
            for (rows, cols), dtypes in cells]


def make_layout(block: int, density: float, causal: bool, heads: int, seq: int, seed: int = 0):
    """A random 0/1 layout (heads, seq/block, seq/block) of about ``density`` of all blocks, diagonal kept.

    A causal layout draws its blocks from the lower triangle only, so that it
    also keeps about ``density`` of the full grid.
    """
    import torch

    blocks = seq // block
    generator = torch.Generator().manual_seed(seed)
    chance = min(1.0, 2 * density) if causal else density
    layout = torch.rand(heads, blocks, blocks, generator=generator) < chance
    layout |= torch.eye(blocks, dtype=torch.bool)
    if causal:
        layout &= torch.ones(blocks, blocks, dtype=torch.bool).tril()
    return layout.to(torch.int64)


def blocksparse_cases(layouts: list) -> list[Case]:
    """One case per (block, density, causal), with Z (1..4) chosen for 64M+ elements."""
    cases = []
    for seed, (block, density, causal) in enumerate(layouts):
        layout = make_layout(block, density, causal, HEADS, SEQ, seed=seed)
        nnz = int(layout.sum())
        per_batch = nnz * block * block
        batch = max(1, min(4, math.ceil(SWEEP_ELEMENTS / per_batch)))
        actual = nnz / layout.numel()
        label = f"b{block} {actual:.0%}{' causal' if causal else ''} Z{batch}"
        cases.append(Case("blocksparse_softmax", "layout", label, (batch, nnz, block, block), batch * per_batch,
                          layout=layout, block=block, causal=causal))
    return cases


def headline_cases(ops: list[str]) -> dict[str, list[Case]]:
    """The cases of HEADLINE_CELLS of each of ``ops`` (that has any), each for its own dtypes."""
    plan = {}
    for op in ops:
        shapes = {}
        for cell_op, dtype, shape in HEADLINE_CELLS:
            if cell_op == op:
                shapes[shape] = shapes.get(shape, ()) + (dtype,)
        if shapes:
            plan[op] = [dataclasses.replace(case, dtypes=shapes[case.shape])
                        for case in dense_cases(op, list(shapes), [])]
    return plan


def plan_cases(ops: list[str], quick: bool, headline: bool = False) -> dict[str, list[Case]]:
    """The cases of each op of OPS: every shape and layout above (cross-entropy's plain cases, then those with
    CROSS_ENTROPY_OPTIONS), with ``quick`` the QUICK_ ones, with ``headline`` HEADLINE_CELLS only (EXTRA_OPS plan
    their own cases)."""
    if headline:
        return headline_cases(ops)
    headline_shapes = QUICK_HEADLINE if quick else HEADLINE
    sweep = sweep_shapes(QUICK_SWEEP_COLS if quick else SWEEP_COLS)
    plan = {}
    for op in ops:
        if op in ("softmax", "log_softmax"):
            plan[op] = dense_cases(op, headline_shapes, sweep)
        elif op == "cross_entropy":
            shapes = QUICK_CROSS_ENTROPY if quick else CROSS_ENTROPY
            cells = [(shape, ()) for shape in QUICK_CROSS_ENTROPY[:1]] if quick else CROSS_ENTROPY_OPTION_CELLS
            plan[op] = dense_cases(op, shapes, []) + option_cases(cells)
        elif op == "blocksparse_softmax":
            plan[op] = blocksparse_cases(QUICK_LAYOUTS if quick else LAYOUTS)
    return plan


# The backends' speed targets, as a fraction of the copy bandwidth: this many for these backends (None: no target;
# the torch backend is PyTorch's own ops), DEFAULT_TARGET for any other.
TARGETS = {"numba": 0.80, "torch": None}
DEFAULT_TARGET = 0.90


def target_of(impl: str) -> float | None:
    """The speed target of a backend, or of its variant ("numba inplace": numba's)."""
    return TARGETS.get(impl.split()[0], DEFAULT_TARGET)


def memory_shortfall(needed: int, device) -> str:
    """Why a case that holds ``needed`` bytes at once is skipped on ``device`` (more than the GPU's memory); ""
    when it fits, or off a GPU."""
    import torch

    if device.type != "cuda":
        return ""
    total = torch.cuda.get_device_properties(device).total_memory
    if needed <= total:
        return ""
    return f"skipped: needs about {needed / 2**30:.0f} GiB, the GPU has {total / 2**30:.0f} GiB"
