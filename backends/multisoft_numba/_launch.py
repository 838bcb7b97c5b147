"""numba-cuda glue: the numpy 2.5 workaround, torch -> numba arrays, device and stream, jit options, launch.

Every kernel module imports this one, so the workaround runs before the first kernel compiles
(which is when numba-cuda builds its registries). It imports no other module of the backend but the description.
"""

from __future__ import annotations

import ctypes
import functools

import numpy
import torch

from . import simulated

# numba-cuda <= 0.30 runs `overload(np.row_stack)(...)` when numba.cuda.np.arrayobj is
# imported (at the first kernel compile), and numpy 2.5 removed np.row_stack, so that
# import raises AttributeError. We give numpy a placeholder row_stack only while that
# one module is imported and remove it right after: the overload then binds to a
# function nobody can reach, and numpy is left as it was.
ROW_STACK_MISSING = not hasattr(numpy, "row_stack")

SIMULATOR = simulated()


def _removed_row_stack(*args, **kwargs):
    raise AttributeError("numpy.row_stack was removed in numpy 2.5; use numpy.vstack")


def import_numba_cuda_arrayobj() -> None:
    """Import numba.cuda.np.arrayobj with a temporary numpy.row_stack (see above)."""
    if SIMULATOR or not ROW_STACK_MISSING:
        return
    numpy.row_stack = _removed_row_stack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401
    finally:
        if getattr(numpy, "row_stack", None) is _removed_row_stack:
            del numpy.row_stack


from numba import cuda  # noqa: E402

import_numba_cuda_arrayobj()

if SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
else:
    from cuda.bindings.utils import get_cuda_native_handle
    from cuda.core import LaunchConfig
    from cuda.core import Stream as CoreStream
    from cuda.core import launch as cuda_core_launch
    from numba.cuda.cudadrv.driver import driver as numba_driver

# Instructions of compute capability 8.0 (max.NaN, cvt.rn.bf16x2) are used only when every
# visible GPU has them: a kernel is compiled for whichever device runs it.
SM80_EVERYWHERE = not SIMULATOR and torch.cuda.is_available() and all(
    torch.cuda.get_device_capability(i) >= (8, 0) for i in range(torch.cuda.device_count()))

# Kernels are launched with at most this many threads per block; the simulator runs
# one CPU thread per CUDA thread, so it gets small blocks.
MAX_THREADS = 16 if SIMULATOR else 1024
MIN_THREADS = 4 if SIMULATOR else 32


def kernel(func=None, *, bound=None):
    """cuda.jit for a kernel: cached on disk, register use bounded for 1024-thread blocks, or by
    `bound` = (threads a block, blocks a multiprocessor).

    numba's disk cache tells kernels apart by code, closure and qualified name, not by launch bounds:
    a kernel bounded otherwise gets the bound in its name, so as not to load another bound's binary."""
    def build(func):
        if SIMULATOR:
            return cuda.jit(func)
        if bound is None:
            return cuda.jit(cache=True, launch_bounds=MAX_THREADS)(func)
        func.__qualname__ += "_bound_" + "_".join(map(str, bound))
        return cuda.jit(cache=True, launch_bounds=bound)(func)

    return build if func is None else build(func)


def device_function(func):
    """cuda.jit(device=True), inlined. Under the simulator a helper that does not touch
    `cuda` stays a plain function: a simulated device call costs a module swap."""
    if SIMULATOR:
        return cuda.jit(device=True)(func) if "cuda" in func.__code__.co_names else func
    return cuda.jit(device=True, forceinline=True)(func)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def as_array(t: torch.Tensor):
    """A numba device array over the tensor's memory (no copy); bfloat16 arrives as int16 bits."""
    t = _kernel_view(t)
    if SIMULATOR:
        return FakeCUDAArray(t.numpy())
    return cuda.as_cuda_array(t, sync=False)


_streams: dict[tuple[int, int], tuple] = {}


def _raw_stream(index: int) -> int:
    """The handle of torch's current stream on device `index`, without building a torch.cuda.Stream."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _current_streams(index: int) -> tuple:
    """torch's current stream on device `index` as (numba's wrapper, for numba's launches; cuda.core's Stream, for
    the fast path: cuda.core deprecates taking numba's wrapper through the stream protocol), made inside that
    device's context."""
    handle = _raw_stream(index)
    streams = _streams.get((index, handle))
    if streams is None:
        with cuda.gpus[index]:
            streams = _streams[(index, handle)] = (cuda.external_stream(handle), CoreStream.from_handle(handle))
    return streams


# The fast launch. numba's own launch re-derives every argument's type and wraps
# every tensor in a DeviceNDArray: hundreds of microseconds a call, more than many of
# these kernels take. After the first launch of a kernel for an argument signature we
# keep its compiled function and hand later launches straight to cuda.core, packing the
# arguments the way numba's _Kernel.launch does (an array is meminfo, parent, size,
# itemsize, data pointer, shape..., strides in bytes...). A driver-API launch needs the
# device's context bound to the calling thread, which torch's runtime leaves unbound in
# some threads (autograd's backward worker): there numba's device context manager binds
# it for the launch.
_compiled: dict[tuple, object] = {}
_configs: dict[tuple, object] = {}   # cuda.core LaunchConfig by (grid, block, shared memory)
_context_handles: dict[int, int] = {}


def _context_is_current(index: int) -> bool:
    """Whether device `index`'s context (the one numba compiled into) is bound to this thread."""
    expected = _context_handles.get(index)
    if expected is None:
        return False
    return get_cuda_native_handle(numba_driver.cuCtxGetCurrent()) == expected


def _signature(args) -> tuple:
    return tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else type(a) for a in args)


def _pack(args) -> list:
    params = []
    for a in args:
        if isinstance(a, torch.Tensor):   # bfloat16 as int16 bits: the same sizes, so no view is needed
            size = a.element_size()
            params += [0, 0, a.numel(), size, a.data_ptr(), *a.shape, *(stride * size for stride in a.stride())]
        elif isinstance(a, (bool, numpy.bool_)):
            params.append(bool(a))
        elif isinstance(a, numpy.float32):
            params.append(ctypes.c_float(a))
        elif isinstance(a, (int, numpy.int64)):
            params.append(ctypes.c_int64(int(a)))
        else:
            raise TypeError(f"cannot pass {type(a)} to a kernel")
    return params


def device_index(device: torch.device) -> int:
    """The index of a CUDA device (torch's current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def multiprocessors(index: int) -> int:
    """The multiprocessor (SM) count of CUDA device `index`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(kernel_, grid, threads: int, args, shared: int = 0) -> None:
    """kernel_[grid, threads] on torch's current stream of the first tensor's device, with `shared` bytes of
    dynamic shared memory a block (at most 48 KiB: more needs an opt-in that this does not make).

    args: contiguous tensors (bfloat16 goes as int16 bits), bools, numpy.float32, numpy.int64.
    """
    if not 0 <= shared <= 48 * 1024:
        raise ValueError(f"shared: {shared} bytes of dynamic shared memory, not 0 to 48 KiB")
    if SIMULATOR:
        kernel_[grid, threads, 0, shared](*[as_array(a) if isinstance(a, torch.Tensor) else a for a in args])
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    index = device_index(device)
    stream, core_stream = _current_streams(index)
    fast = index == torch.cuda.current_device() and all(
        a.is_contiguous() for a in args if isinstance(a, torch.Tensor))
    key = (id(kernel_), index, _signature(args)) if fast else None
    compiled = _compiled.get(key) if fast else None
    if compiled is not None:
        config = _configs.get((grid, threads, shared))
        if config is None:
            if len(_configs) >= 4096:   # shapes that keep changing: keep the cache bounded
                _configs.clear()
            config = _configs[(grid, threads, shared)] = LaunchConfig(grid=grid, block=threads, shmem_size=shared)
        params = _pack(args)
        if _context_is_current(index):
            cuda_core_launch(core_stream, config, compiled, *params)
        else:
            with cuda.gpus[index]:
                cuda_core_launch(core_stream, config, compiled, *params)
        return
    with cuda.gpus[index]:
        arrays = [as_array(a) if isinstance(a, torch.Tensor) else a for a in args]
        kernel_[grid, threads, stream, shared](*arrays)
        if fast:
            overload = kernel_.overloads.get(tuple(kernel_.typeof_pyval(a) for a in arrays))
            if overload is None:
                return
            try:
                handle = get_cuda_native_handle(cuda.current_context().handle)
                compiled = overload._codelibrary.get_cufunc().kernel
            except Exception:   # numba internals not as expected: keep numba's own launch
                return
            _context_handles[index] = handle
            _compiled[key] = compiled


FP32, FP16, BF16 = 0, 1, 2   # element formats of the kernels (_device.row_io)


def vector_views(tensors, max_width=None):
    """(element format, width, the tensors as the kernels' word arrays) for reading and
    writing rows `width` elements at a time (see _device.row_io): the widest access of at
    most 16 bytes (and at most max_width elements) that divides every row length and
    stride and to which every tensor's data is aligned."""
    dtype = tensors[0].dtype
    fmt = {torch.float32: FP32, torch.float16: FP16, torch.bfloat16: BF16}[dtype]
    size = tensors[0].element_size()
    width = 16 // size if max_width is None else min(16 // size, max_width)
    while width > 1 and not all(_fits(t, width, size) for t in tensors):
        width //= 2
    word_dtype = torch.float32 if fmt == FP32 else torch.int16 if width == 1 else torch.int32
    return fmt, width, tuple(t.detach().view(word_dtype) for t in tensors)


def _fits(t: torch.Tensor, width: int, size: int) -> bool:
    """Whether every row of t starts on a width-element boundary and holds whole vectors."""
    return (t.data_ptr() % (width * size) == 0 and t.shape[-1] % width == 0 and t.stride(-1) == 1
            and all(stride % width == 0 for stride in t.stride()[:-1]))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def threads_for(n: int, per_thread: int) -> int:
    """A power-of-two block size giving each thread about per_thread of n elements."""
    return max(min(next_pow2(-(-n // per_thread)), MAX_THREADS), MIN_THREADS)
