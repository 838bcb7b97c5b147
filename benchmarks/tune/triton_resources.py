"""Registers, occupancy and memory instructions of the Triton kernels, compiled for a GPU without one.

Triton compiles for any NVIDIA target with the ptxas it ships; `cuobjdump` (shipped too) reads the
registers and the machine code. This prints, for the kernel configurations the benchmark shapes
take, the registers per thread, the local stores and loads (spills), the programs one multiprocessor
can hold (by registers and threads), and the global loads and stores by width: what bounds the bytes
a multiprocessor has in flight.

    python3 benchmarks/tune/triton_resources.py                  # every configuration, sm_90
    python3 benchmarks/tune/triton_resources.py --only split --sass /tmp/sass   # and their SASS

Run it without TRITON_INTERPRET (the interpreter replaces the kernels). The numbers are the local
triton's; the GPU machine's may differ (say which triton printed them).
"""
import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
PROGRAMS_PER_SM = 32


def configurations():
    """(name, kernel, signature, constexprs, num_warps) for the paths of the benchmark shapes."""
    from multisoft_triton import blocksparse, cross_entropy, softmax

    found = []
    for dtype in ("fp32", "bf16"):
        size = 4 if dtype == "fp32" else 2
        ptr = f"*{dtype}"
        fwd = {"x_ptr": ptr, "out_ptr": ptr, "M": "i32", "N": "i32"}
        bwd = {"y_ptr": ptr, "dy_ptr": ptr, "dx_ptr": ptr, "M": "i32", "N": "i32", "zero": "i32"}
        raws = (False, True) if size == 2 else (False,)
        for n in (1024, 4096, 32768):
            rows = max(1, softmax.TILE_ELEMENTS[size] // n)
            found.append((f"softmax-fwd-tile-{dtype}-{n}", softmax._fwd_tile_kernel, fwd,
                          {"ROWS": rows, "BLOCK": n, "LOG": False}, softmax.warps_for(rows * n)))
            for raw in raws:
                tag = "-raw" if raw else ""
                if n <= softmax.BACKWARD_TILE_MAX[size]:
                    found.append((f"softmax-bwd-tile-{dtype}-{n}{tag}", softmax._bwd_tile_kernel, bwd,
                                  {"ROWS": rows, "BLOCK": n, "LOG": False, "RAW": raw},
                                  softmax.warps_for(2 * rows * n)))
        if size in softmax.PREFETCH_FROM:
            block = softmax.PREFETCH_FROM[size]
            found.append((f"softmax-fwd-prefetch-{dtype}-{block}", softmax._fwd_prefetch_kernel, fwd,
                          {"BLOCK": block, "LOG": False}, softmax.warps_for(block)))
        chunk, warps = softmax.SPLIT_CONFIGS[0]
        split = {"CHUNK": chunk, "CHUNKS_P2": 64, "LOG": False, "TICKET": softmax.SPLIT_TICKET,
                 "COUNTER_STRIDE": softmax.SPLIT_COUNTER_STRIDE}
        stats = {"count_ptr": "*i32", "N": "i32", "chunks": "i32"}
        held = {"count_ptr": "*i32", "N": "i32", "chunks": "i32", "zero": "i32"}
        cap = {"maxnreg": softmax.SPLIT_FORWARD_MAXNREG[size]} if size in softmax.SPLIT_FORWARD_MAXNREG else {}
        found.append((f"softmax-fwd-split-{dtype}-{chunk}", softmax._fwd_split_kernel,
                      {"x_ptr": ptr, "out_ptr": ptr, "max_ptr": "*fp32", "sum_ptr": "*fp32", **stats},
                      split, warps, cap))
        if size in softmax.SPLIT_STREAM:
            chunk_s, sub, warps_s, stages = softmax.SPLIT_STREAM[size]
            found.append((f"softmax-fwd-split-stream-{dtype}-{chunk_s}", softmax._fwd_split_stream_kernel,
                          {"x_ptr": ptr, "out_ptr": ptr, "max_ptr": "*fp32", "sum_ptr": "*fp32", **stats},
                          {**split, "CHUNK": chunk_s, "SUB": sub, "STAGES": stages}, warps_s, cap))
        for raw in raws:
            found.append((f"softmax-bwd-split-{dtype}-{chunk}{'-raw' if raw else ''}", softmax._bwd_split_kernel,
                          {"y_ptr": ptr, "dy_ptr": ptr, "dx_ptr": ptr, "sum_ptr": "*fp32", **held},
                          {**split, "RAW": raw, "LATE_Y": softmax.SPLIT_LATE_Y[size]}, warps))
        scalars = {"ignore_index": "i64", "keep": "fp32", "smooth_per_class": "fp32"}
        found.append((f"cross_entropy-fwd-loop-{dtype}", cross_entropy._fwd_loop_kernel,
                      {"logits_ptr": ptr, "target_ptr": "*i64", "weight_ptr": "*fp32", "loss_ptr": "*fp32",
                       "lse_ptr": "*fp32", "row_weight_ptr": "*fp32", "C": "i32", **scalars},
                      {"BLOCK": cross_entropy.LOOP_CONFIGS[size][0], "STAGES": cross_entropy.LOOP_STAGES,
                       "HAS_WEIGHT": False, "SMOOTH": False}, cross_entropy.LOOP_CONFIGS[size][1]))
        block = cross_entropy.BACKWARD_BLOCK
        found.append((f"cross_entropy-bwd-{dtype}", cross_entropy._bwd_kernel,
                      {"logits_ptr": ptr, "target_ptr": "*i64", "weight_ptr": "*fp32", "weight_sum_ptr": "*fp32",
                       "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32", "grad_stride": "i32", "grad_ptr": ptr, "M": "i32",
                       "C": "i32",
                       **scalars},
                      {"ROWS": 1, "BLOCK": block, "HAS_WEIGHT": False, "SMOOTH": False},
                      cross_entropy.warps_for(block)))
        for block, blocks in ((16, 64), (64, 16)):
            tile, slab, rows = blocksparse._plan(blocks, block)
            found.append((f"blocksparse-bwd-b{block}x{blocks}-{dtype}", blocksparse._bwd_tile_kernel,
                          {"y_ptr": ptr, "dy_ptr": ptr, "dx_ptr": ptr, "rows_ptr": "*i32", "rows": "i32",
                           "nnz": "i32", "scale": "fp32"},
                          {"BLOCKS": slab, "ROWS": rows, "B": block}, blocksparse.warps_for(slab * rows * block)))
        rows_table = {"offsets_ptr": "*i32", "nnz": "i32", "scale": "fp32"}
        fwd_rows = {"x_ptr": ptr, "out_ptr": ptr, "offsets_ptr": "*i32", "nnz": "i32", "c": "fp32",
                    "causal_ptr": "*i32"}
        for block, blocks in ((16, 32), (64, 8), (64, 16)):
            rows = min(block, blocksparse.ROW_WARPS)
            inner = blocksparse._row_inner("forward", size, block, blocks)
            for causal in (False, True):
                found.append((f"blocksparse-fwd-rows-b{block}x{blocks}{'-causal' if causal else ''}-{dtype}",
                              blocksparse._fwd_rows_kernel, fwd_rows,
                              {"BLOCKS": blocks, "ROWS": rows, "B": block, "CAUSAL": causal, "SIGN": 1,
                               "INNER": inner}, rows))
            across = max(1, min(block, 32 * (16 // size) // block))   # rows across one warp's lanes
            held = blocksparse.FORWARD_ACROSS_BLOCKS[size]
            found.append((f"blocksparse-fwd-across-b{block}x{held}-causal-{dtype}", blocksparse._fwd_rows_kernel,
                          fwd_rows, {"BLOCKS": held, "ROWS": across, "B": block, "CAUSAL": True, "SIGN": 1,
                                     "INNER": 1}, 1))
            found.append((f"blocksparse-bwd-rows-b{block}x{blocks}-{dtype}", blocksparse._bwd_rows_kernel,
                          {"y_ptr": ptr, "dy_ptr": ptr, "dx_ptr": ptr, **rows_table, "zero": "i32"},
                          {"BLOCKS": blocks, "ROWS": rows, "B": block,
                           "INNER": blocksparse._row_inner("backward", size, block, blocks),
                           "RAW": size == 2 and blocksparse.ROW_RAW},
                          rows))
        found.append((f"blocksparse-fwd-rows-b64x16-long-{dtype}", blocksparse._fwd_rows_kernel, fwd_rows,
                      {"BLOCKS": 16, "ROWS": 1, "B": 64, "CAUSAL": False, "SIGN": 1,
                       "INNER": blocksparse._row_inner("forward", size, 64, 16)}, 1))
    return found


def compile_for(kernel, signature, constexprs, num_warps, arch, options=None):
    """The cubin of `kernel` for sm_<arch>, pointers and M, N, C taken as multiples of 16 (as the launcher
    specialises them on the GPU: without that no load is vectorised), with the launchers' options
    (utils.LAUNCH); `options`: more compile options (maxnreg)."""
    import triton
    from multisoft_triton.utils import LAUNCH
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n in ("M", "N", "C")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, **LAUNCH, **(options or {})})
    return compiled.asm["cubin"]


def cuobjdump(*args):
    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def report(cubin, num_warps):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        usage = cuobjdump("-res-usage", handle.name)
        sass = cuobjdump("-sass", handle.name)
    finally:
        os.unlink(handle.name)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    # spills show as local stores and loads in the machine code (res-usage's LOCAL can read 0 with them)
    stores, loads = (len(re.findall(rf"\b{op}\b", sass)) for op in ("STL", "LDL"))
    local = f"{stores}/{loads}"
    threads = 32 * num_warps
    by_registers = REGISTERS_PER_SM // (-(-regs // 8) * 8 * threads)
    programs = min(by_registers, THREADS_PER_SM // threads, PROGRAMS_PER_SM)
    # e.g. LDG.E.EL.128 (with a cache hint) counts as LDG.E.128; no width: 32 bits
    memory = collections.Counter(f"{op}.E{'.' + width if width else ''}" for op, width in
                                 re.findall(r"\b(LDG|STG|LDGSTS)\.E(?:\.[A-Z_]+)*(?:\.(\d+))?\b", sass))
    return regs, local, programs, memory, sass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (default 90)")
    parser.add_argument("--only", default="", help="names containing this")
    parser.add_argument("--sass", default="", help="write each kernel's SASS into this folder")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}")
    print(f"{'configuration':36} {'warps':>5} {'regs':>4} {'STL/LDL':>7} {'programs/SM':>11}  global loads/stores")
    for name, kernel, signature, constexprs, warps, *options in configurations():
        if args.only not in name:
            continue
        cubin = compile_for(kernel, signature, constexprs, warps, args.arch, *options)
        regs, local, programs, memory, sass = report(cubin, warps)
        accesses = " ".join(f"{op}:{count}" for op, count in sorted(memory.items()))
        print(f"{name:36} {warps:5d} {regs:4d} {local:>7} {programs:11d}  {accesses}", flush=True)
        if args.sass:
            pathlib.Path(args.sass).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(args.sass) / f"{name}.sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
