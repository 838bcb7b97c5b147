"""Compile every CUDA source of the CuPy backend with NVRTC, for sm_80 and sm_90, no GPU needed.

NVRTC comes from pip: `nvidia-cuda-nvrtc` (CUDA 13) or `nvidia-cuda-nvrtc-cu12`.
The sources need no CUDA header. Skips only when no libnvrtc is installed.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))
from multisoft_cupy import _catalog  # noqa: E402  (imports no CUDA framework)

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
    return (_catalog.PACKAGE_DIR / name).read_text()


CASES = [(s, c, a) for s in _catalog.SOURCES for c in _catalog.CUDA_TYPES for a in ARCHS]


def _compile_case(nvrtc: NVRTC, case) -> int | str:
    """Cubin size, or the error text."""
    source, ctype, arch = case
    expressions = _catalog.expressions(source, ctype, int(arch.split("_")[1]))
    options = [f"--gpu-architecture={arch}", *_catalog.OPTIONS]
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
    on_disk = {p.name for p in _catalog.PACKAGE_DIR.glob("*.cu")}
    assert on_disk == set(_catalog.SOURCES)


def test_syntax_error_fails(nvrtc):
    broken = _source("softmax.cu").replace("const float inv_sum", "const float inv_sum +", 1)
    assert broken != _source("softmax.cu")
    with pytest.raises(RuntimeError, match="error"):
        nvrtc.compile(broken, "softmax.cu", ["--gpu-architecture=sm_90", *_catalog.OPTIONS],
                      _catalog.expressions("softmax.cu", "float", 90))


def test_missing_instantiation_fails(nvrtc):
    with pytest.raises(RuntimeError):
        nvrtc.compile(_source("softmax.cu"), "softmax.cu", ["--gpu-architecture=sm_90", *_catalog.OPTIONS],
                      ("softmax_fwd<double, 32, 4, 1>",))
