"""Compile every CUDA source of the CuPy backend with NVRTC, for sm_80 and sm_90, no GPU needed.

The kernel instances compiled are multisoft_cupy._instances.expressions; the
tests at the end check that every instance _tuning can choose for a call is
among them. NVRTC comes from pip: `nvidia-cuda-nvrtc` (CUDA 13) or
`nvidia-cuda-nvrtc-cu12`. The sources need no CUDA header. The compile tests skip
only when no libnvrtc is installed.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import itertools
import os
import sys

import pytest

from multisoft_cupy import _instances, _tuning  # (import no CUDA framework)

ARCHS = ("sm_80", "sm_90")


def _find_nvrtc() -> str | None:
    patterns = ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*")
    for root in sys.path:
        for pattern in patterns:
            for path in sorted(glob.glob(os.path.join(root, pattern)), reverse=True):
                if "builtins" not in os.path.basename(path):
                    return path
    return None


class NVRTC:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, code: str, name: str, options: list[str], expressions: tuple[str, ...] = ()) -> int:
        """Compiles to a cubin; returns its size. Raises with the compiler log on any error."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            for expr in expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()), f"add {expr}")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            if status != 0:
                raise RuntimeError(f"{name}: {self.lib.nvrtcGetErrorString(status).decode()}\n{log.value.decode()}")
            for expr in expressions:
                lowered = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)), f"lowered {expr}")
                assert lowered.value, expr
            cubin = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
            return cubin.value
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc() -> NVRTC:
    path = _find_nvrtc()
    if path is None:
        pytest.skip("no NVRTC installed: pip install nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12")
    return NVRTC(path)


def _source(name: str) -> str:
    return (_instances.PACKAGE_DIR / name).read_text()


CASES = [(s, c, a) for s in _instances.SOURCES for c in _instances.CUDA_TYPES for a in ARCHS]


def _compile_case(nvrtc: NVRTC, case) -> int | str:
    """Cubin size, or the error text."""
    source, ctype, arch = case
    expressions = _instances.expressions(source, ctype, int(arch.split("_")[1]))
    options = [f"--gpu-architecture={arch}", *_instances.OPTIONS]
    try:
        return nvrtc.compile(_source(source), source, options, expressions) if expressions else "no instantiations"
    except RuntimeError as error:
        return str(error)


class _OnDemand(dict):
    """Each case compiled when first asked for."""

    def __init__(self, nvrtc: NVRTC):
        super().__init__()
        self.nvrtc = nvrtc

    def __missing__(self, case):
        self[case] = _compile_case(self.nvrtc, case)
        return self[case]


@pytest.fixture(scope="module")
def compiled(nvrtc) -> dict:
    """Every case's cubin size or error. In one process, all compiled at once on every core (NVRTC calls release the
    GIL); in a pytest-xdist worker, only the cases it runs (the workers share the cases and the cores)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _OnDemand(nvrtc)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(CASES, pool.map(lambda case: _compile_case(nvrtc, case), CASES)))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_source_compiles(compiled, case):
    result = compiled[case]
    assert isinstance(result, int) and result > 0, result


def test_every_source_file_is_listed():
    on_disk = {p.name for p in _instances.PACKAGE_DIR.glob("*.cu")}
    assert on_disk == set(_instances.SOURCES)


def test_syntax_error_fails(nvrtc):
    source = _instances.SOFTMAX_ROWS_SOURCE
    broken = _source(source).replace("const float inv_sum", "const float inv_sum +", 1)
    assert broken != _source(source)
    with pytest.raises(RuntimeError, match="error"):
        nvrtc.compile(broken, source, ["--gpu-architecture=sm_90", *_instances.OPTIONS],
                      _instances.expressions(source, "float", 90))


def test_missing_instantiation_fails(nvrtc):
    source = _instances.SOFTMAX_ROWS_SOURCE
    with pytest.raises(RuntimeError):
        nvrtc.compile(_source(source), source, ["--gpu-architecture=sm_90", *_instances.OPTIONS],
                      ("softmax_fwd<double, 32, 4, 1>",))


def test_split_counter_stride_is_the_kernels():
    assert f"#define MS_COUNTER_STRIDE {_instances.SPLIT_COUNTER_STRIDE} " in _source(_instances.SOFTMAX_SPLIT_SOURCE)


# Column counts from 1 to 2**25: powers of two, three and five times them, and their neighbours.
_COLUMNS = sorted({n + d for n in (m << e for e in range(25) for m in (1, 3, 5)) for d in (-1, 0, 1) if n + d > 0})
_ELEMENTS = (("float", 4), ("f16_t", 2), ("bf16_t", 2))


@pytest.mark.parametrize("cc", [80, 90])
def test_every_softmax_kernel_a_call_can_choose_is_compiled(cc):
    """_tuning's choices of softmax kernel over column counts, row counts, shared memory and multiprocessor counts
    are all in the lists that test_source_compiles compiles."""
    rows_kernels = _compiled(_instances.SOFTMAX_ROWS_SOURCE, cc)
    staged_kernels = _compiled(_instances.SOFTMAX_STAGED_SOURCE, cc)
    split_kernels = _compiled(_instances.SOFTMAX_SPLIT_SOURCE, cc)
    chosen = {"rows": 0, "staged": 0, "split": 0}
    for (ctype, elem), direction, columns in itertools.product(_ELEMENTS, ("fwd", "bwd"), _COLUMNS):
        cfg = _tuning.softmax_config(direction, columns, elem, cc)
        assert _instances.softmax_kernel(direction, ctype, cfg) in rows_kernels[ctype], (direction, columns)
        chosen["rows"] += 1
        for max_shared in (48 * 1024, 99 * 1024, 227 * 1024):
            staged = _tuning.staged_config(direction, columns, elem, cc, max_shared)
            if staged is not None:
                assert _instances.staged_kernel(direction, ctype, staged) in staged_kernels[ctype], (direction, columns)
                chosen["staged"] += 1
        for rows, sm_count in itertools.product((1, 1000, 1 << 20), (108, 132)):
            split = _tuning.split_config(direction, rows, columns, elem, cc, sm_count)
            if split is not None:
                assert _instances.split_kernel(direction, ctype, split) in split_kernels[ctype], (direction, columns)
                chosen["split"] += 1
    assert all(chosen.values()), chosen


@pytest.mark.parametrize("cc", [80, 90])
def test_every_cross_entropy_kernel_a_call_can_choose_is_compiled(cc):
    """The forward for every shape, with and without the gradient and the softcap (as cross_entropy.forward and
    probabilities_forward name them), and the gradient's scaling."""
    kernels = _compiled(_instances.CROSS_ENTROPY_SOURCE, cc)
    flags = list(itertools.product((False, True), repeat=2))
    for (ctype, elem), index_type in itertools.product(_ELEMENTS, _instances.INDEX_TYPES):
        for rows, classes, sm_count in itertools.product((1, 7, 64, 132, 264, 8192), _COLUMNS, (108, 132)):
            cfg = _tuning.ce_fwd_config(rows, classes, elem, cc, sm_count)
            for grad, softcap in flags:
                expression = _instances.ce_fwd_kernel(ctype, index_type, grad, softcap, cfg)
                assert expression in kernels[ctype], (rows, classes)
                probabilities = _instances.ce_probs_fwd_kernel(ctype, grad, softcap, cfg)
                assert probabilities in kernels[ctype], (rows, classes, "class probabilities")
        assert _instances.ce_scale_kernel(ctype, _tuning.CE_SCALE_CONFIG) in kernels[ctype]


@pytest.mark.parametrize("cc", [80, 90])
def test_every_blocksparse_kernel_a_call_can_choose_is_compiled(cc):
    """Staged forward, register forward (the fallback) and register backward with the lanes the launchers choose:
    mean rows from a block to 4096 blocks, longest rows up to 8 times the mean, every block size."""
    kernels = _compiled(_instances.BLOCKSPARSE_SOURCE, cc)
    for (ctype, elem), block in itertools.product(_ELEMENTS, (16, 32, 64, 128)):
        for mean_blocks, longer in itertools.product((1, 1.5, 2.7, 4, 7.3, 16, 33.3, 128, 500, 4096), (1, 2, 8)):
            mean_row = mean_blocks * block
            staged = _tuning.blocksparse_staged_config(mean_row, int(longer * mean_row), elem, cc, block)
            assert _instances.blocksparse_staged_kernel(ctype, staged) in kernels[ctype], (block, mean_blocks)
            forward = _tuning.blocksparse_register_config("fwd", mean_row, elem)
            assert _instances.blocksparse_kernel("fwd", ctype, forward) in kernels[ctype], (block, mean_blocks)
            lanes = _tuning.blocksparse_backward_lanes(mean_row, block, elem)
            backward = _tuning.blocksparse_register_config("bwd", mean_row, elem, lanes)
            assert _instances.blocksparse_kernel("bwd", ctype, backward) in kernels[ctype], (block, mean_blocks)


def _compiled(source: str, cc: int) -> dict[str, set[str]]:
    return {ctype: set(_instances.expressions(source, ctype, cc)) for ctype in _instances.CUDA_TYPES}
