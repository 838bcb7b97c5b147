"""The rows an op processes at a time, so that its temporaries stay bounded whatever the tensor's size.

An op keeps a few float32 temporaries of a chunk's size. On the CPU a chunk is
about ``CHUNK_ELEMENTS`` elements (8 MiB of float32, within the last-level
cache); elsewhere ``GPU_CHUNK_ELEMENTS`` (64 MiB), so that each of the chunk's
kernel launches moves enough memory to hide its launch. A chunk holds at least
one row.
"""

CHUNK_ELEMENTS = 1 << 21
GPU_CHUNK_ELEMENTS = 1 << 24


def slices(count: int, elements_each: int, device) -> list[slice]:
    """Consecutive slices covering ``range(count)``, each of as many items of ``elements_each`` elements as fill a
    chunk on ``device`` (at least one)."""
    budget = CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS
    step = max(1, budget // max(1, elements_each))
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]
