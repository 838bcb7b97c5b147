"""Compiles the package's .cu sources with cupy.RawModule and launches kernels on torch's stream.

Kernels are compiled on first use, one module per (device, source, element type,
instantiation), so a call compiles only what it launches. CuPy also keeps the
binaries on disk ($CUPY_CACHE_DIR, default ~/.cupy/kernel_cache); `clear_cache()`
drops the in-process modules, so the next call reloads (or, with a cold disk
cache, recompiles) them. Arguments are raw device pointers of torch tensors:
CuPy allocates nothing.
"""

from __future__ import annotations

import threading
import warnings

import cupy
import numpy
import torch

from . import _instances

_CTYPE = {torch.float32: "float", torch.float16: "f16_t", torch.bfloat16: "bf16_t"}
_INDEX_CTYPE = {torch.int32: "int", torch.int64: "long long"}

_lock = threading.Lock()
_modules: dict[tuple[int, str, str, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str, str, str], object] = {}
_sources: dict[str, str] = {}
_device_info: dict[int, tuple[int, int]] = {}
_shared_memory: dict[int, int] = {}
_shared_set: dict[tuple[int, str, str], int] = {}
_streams: dict[tuple[int, int], object] = {}


def clear_cache() -> None:
    """Forget every compiled module, so that the next call of each kernel loads (or compiles) it again."""
    with _lock:
        _modules.clear()
        _functions.clear()
        _shared_set.clear()
        _sources.clear()


def ctype(dtype: torch.dtype) -> str:
    return _CTYPE[dtype]


def index_ctype(dtype: torch.dtype) -> str:
    return _INDEX_CTYPE[dtype]


def _source(name: str) -> str:
    # The local header is inlined so that CuPy's disk cache, keyed by the code, sees header edits.
    if name not in _sources:
        code = (_instances.PACKAGE_DIR / name).read_text()
        for header in _instances.HEADERS:
            code = code.replace(f'#include "{header}"', (_instances.PACKAGE_DIR / header).read_text())
        _sources[name] = code
    return _sources[name]


def device_index(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


def device_info(index: int) -> tuple[int, int]:
    """(compute capability as 90, multiprocessor count) of a CUDA device."""
    if index not in _device_info:
        props = torch.cuda.get_device_properties(index)
        _device_info[index] = (props.major * 10 + props.minor, props.multi_processor_count)
    return _device_info[index]


def shared_memory(index: int) -> int:
    """Dynamic shared memory one block may opt in to on device `index`, in bytes, less 1.25 KB for the
    kernels' static shared memory."""
    if index not in _shared_memory:
        props = torch.cuda.get_device_properties(index)
        _shared_memory[index] = getattr(props, "shared_memory_per_block_optin", 48 * 1024) - 1280
    return _shared_memory[index]


def kernel(index: int, source: str, element: str, expression: str):
    """The compiled kernel `expression` of `source` for `element` on device `index` (compiled on first use)."""
    key = (index, source, element, expression)
    function = _functions.get(key)
    if function is not None:
        return function
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                with cupy.cuda.Device(index):
                    module = cupy.RawModule(code=_source(source), options=_instances.OPTIONS,
                                            name_expressions=(expression,))
                    module.compile()
                _modules[key] = module
    with cupy.cuda.Device(index):
        function = _functions[key] = module.get_function(expression)
    return function


def _stream(index: int):
    """CuPy's view of torch's current stream on device `index` (cached per stream handle)."""
    handle = _raw_stream(index)
    stream = _streams.get((index, handle))
    if stream is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
            stream = cupy.cuda.ExternalStream(handle, index)
        _streams[(index, handle)] = stream
    return stream


def _raw_stream(index: int) -> int:
    """The handle of torch's current stream on device `index`, without building a torch.cuda.Stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def launch(tensor: torch.Tensor, source: str, expression: str, grid: tuple, block: tuple, args: tuple,
           shared_mem: int = 0) -> None:
    """Runs `expression` of `source` on `tensor`'s device, on torch's current stream there, with `shared_mem`
    bytes of dynamic shared memory per block."""
    index = device_index(tensor)
    fn = kernel(index, source, ctype(tensor.dtype), expression)
    with cupy.cuda.Device(index), _stream(index):
        key = (index, ctype(tensor.dtype), expression)
        # Without the opt-in a block may hold 48 KB less the kernel's static shared memory, so even a dynamic
        # size just under 48 KB can fail to launch: opt in to whatever is asked, once per kernel.
        if shared_mem and _shared_set.get(key, 0) < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem
            _shared_set[key] = shared_mem
        fn(grid, block, args, shared_mem=shared_mem)


def ptr(tensor: torch.Tensor | None) -> numpy.uint64:
    return numpy.uint64(0 if tensor is None else tensor.data_ptr())


def aligned(*tensors: torch.Tensor) -> bool:
    """True when every tensor's storage starts on a 16-byte boundary (vector loads)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


i64 = numpy.int64
i32 = numpy.int32
f32 = numpy.float32
