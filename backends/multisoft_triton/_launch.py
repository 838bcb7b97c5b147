"""Launch glue shared by the op modules: launch options, the current device, device properties, launch sizes, and
`launch`, which sends a repeated call straight to its compiled kernel."""
import contextlib
import functools

import torch
import triton

from . import simulated

# Options of every launch. The kernels were tuned with a * b + c compiled as one FMA, triton's default through 3.9,
# which warns that 3.10 will no longer fuse by default (TRITON_DEFAULT_FP_FUSION): they ask for it.
LAUNCH = {"enable_fp_fusion": True}


def on_device(tensor):
    """Context that makes `tensor`'s CUDA device current (triton launches on its current stream); nothing to do
    when it already is."""
    if tensor.is_cuda:
        index = tensor.get_device()
        if index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(tensor):
    """Streaming multiprocessors of `tensor`'s GPU (0 on CPU)."""
    if not tensor.is_cuda:
        return 0
    return _sm_count(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def next_power_of_2(n):
    return 1 << (max(1, int(n)) - 1).bit_length()


def warps_for(elements):
    """num_warps giving each thread about 32 elements of a tile (4..32 warps)."""
    return max(4, min(32, elements // 1024))


# Triton's JIT dispatch derives a call's specialisation from every argument, looks the compiled kernel up and asks
# the driver for the stream: tens of microseconds a launch, more than a small kernel runs. `launch` does that once
# per specialisation (the first call goes through triton as usual and hands back its compiled kernel), then calls
# the compiled kernel's launcher itself. Its key is finer than Triton's: an argument's dtype and 16-byte alignment
# for a tensor; for an int, whether it is 1, a multiple of 16, and which of int32, int64 or uint64 holds it; the
# values of the keyword arguments (constexprs and launch options); the device. Two calls with the same key compile
# to the same kernel, so the cached one is the kernel Triton would have launched.
_ready: dict[tuple, tuple] = {}
_DIRECT = not simulated()
_NO_KEY = object()   # an argument `launch` cannot key: such a call always goes through triton


def _argument_key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63
    if isinstance(value, float):
        return float
    return None if value is None else _NO_KEY


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` on torch's current stream of the current device (see above)."""
    if not _DIRECT:
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    signature = tuple(_argument_key(a) for a in args)
    key = (kernel, device, signature, *kwargs.items())
    ready = _ready.get(key)
    if ready is None:
        compiled = kernel[grid](*args, **kwargs)
        names = getattr(kernel, "arg_names", None)
        if (_NO_KEY not in signature and names is not None and hasattr(compiled, "packed_metadata")
                and all(name in kwargs for name in names[len(args):])):
            # the launcher takes every parameter in order, constexprs included (it skips them)
            _ready[key] = (compiled, tuple(kwargs[name] for name in names[len(args):]))
        return
    compiled, constexprs = ready
    arguments = (*args, *constexprs)
    stream = _current_stream(device)
    hooks = triton.knobs.runtime
    # what triton's JITFunction.run does once it has found the compiled kernel
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *arguments),
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *arguments)


def _current_stream(device):
    return triton.runtime.driver.active.get_current_stream(device)
