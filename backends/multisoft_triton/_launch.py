"""Launch glue shared by the op modules: launch options, the current device, device properties, launch sizes."""
import contextlib
import functools

import torch
import triton

# Options of every launch. The kernels were tuned with a * b + c compiled as one FMA, triton's default through 3.9,
# which warns that 3.10 will no longer fuse by default (TRITON_DEFAULT_FP_FUSION): they ask for it.
LAUNCH = {"enable_fp_fusion": True}


def on_device(tensor):
    """Context that makes `tensor`'s CUDA device current (triton launches on its current stream)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
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
    return triton.next_power_of_2(max(1, int(n)))


def warps_for(elements):
    """num_warps giving each thread about 32 elements of a tile (4..32 warps)."""
    return max(4, min(32, elements // 1024))
