"""Compile every Triton kernel variant for a CUDA target on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute but not that they compile:
it runs the kernel body as Python. This module runs Triton's real compiler (front end to PTX and
cubin, with the ptxas bundled in the triton wheel) for each constexpr variant the launchers use, so
type errors of the compiled path show up on CPU-only machines too.

    TRITON_INTERPRET=0 python -m mmspec.kernels.compile_check [--arch 90]

Needs triton with its NVIDIA backend; no GPU, no driver.
"""

from __future__ import annotations

import argparse
import itertools
import os

_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}  # as the launchers use them
_PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "fp64": "*fp64"}


def _representative(dtype: str, has_q: bool, greedy: bool, k_one: bool, tok: str) -> bool:
    return (dtype, has_q, greedy, k_one, tok) in {
        ("fp32", True, False, False, "i64"), ("fp32", False, False, True, "i64"), ("fp32", True, True, False, "i64"),
        ("bf16", False, False, False, "i32"), ("fp64", True, False, False, "i64"), ("fp16", False, True, True, "i64"),
    }


def compile_all(arch: int = 90, full: bool = True) -> list[str]:
    """Compile the kernel variants for ``sm_<arch>``; return their names. Raises on the first failure.

    ``full=False`` compiles a representative subset (each constexpr branch at least once, ~10 s);
    ``full=True`` every combination (~40 s on two CPU cores).
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0 (the interpreter skips compilation)")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mmspec.kernels.chain_verify_triton import _chain_verify_kernel
    from mmspec.kernels.neighborhood_mass_triton import _neighborhood_mass_kernel

    target = GPUTarget("cuda", arch, 32)
    done = []
    # Chain verification: every dtype x draft-probs x greedy, with K a runtime int and K == 1 (which
    # Triton specialises into a constant), int32 and int64 tokens.
    for dtype, has_q, greedy, k_one, tok in itertools.product(
            _PTR, (True, False), (True, False), (False, True), ("i64", "i32")):
        if not full and not _representative(dtype, has_q, greedy, k_one, tok):
            continue
        u = "*fp64" if dtype == "fp64" else "*fp32"
        signature = {"draft_tokens_ptr": f"*{tok}", "draft_probs_ptr": _PTR[dtype],
                     "target_probs_ptr": _PTR[dtype], "accept_u_ptr": u, "sample_u_ptr": u,
                     "num_accepted_ptr": "*i64", "next_tokens_ptr": "*i64",
                     "K": "constexpr" if k_one else "i32", "V": "i32",
                     "HAS_DRAFT_PROBS": "constexpr", "GREEDY": "constexpr", "FP64": "constexpr",
                     "BLOCK_K": "constexpr", "BLOCK_V": "constexpr"}
        constexprs = {"HAS_DRAFT_PROBS": has_q, "GREEDY": greedy, "FP64": dtype == "fp64",
                      "BLOCK_K": 2 if k_one else 16, "BLOCK_V": 512 if greedy else 1024}
        if k_one:
            constexprs["K"] = 1
        triton.compile(ASTSource(_chain_verify_kernel, signature, constexprs), target=target, options=_OPTIONS)
        done.append(f"chain_verify[{dtype}, draft_probs={has_q}, greedy={greedy}, K==1={k_one}, {tok}]")
    # Split-V chain verification: its four kernels, every dtype x draft-probs (K a runtime int).
    from mmspec.kernels.chain_verify_split_triton import (
        _split_argmax_kernel,
        _split_greedy_kernel,
        _split_mass_kernel,
        _split_sample_kernel,
    )

    for dtype, has_q in itertools.product(_PTR, (True, False)):
        if not full and (dtype, has_q) not in (("fp32", True), ("bf16", False), ("fp64", True)):
            continue
        u = "*fp64" if dtype == "fp64" else "*fp32"
        common = {"draft_tokens_ptr": "*i64", "draft_probs_ptr": _PTR[dtype], "target_probs_ptr": _PTR[dtype],
                  "accept_u_ptr": u}
        sizes = {"K": "i32", "V": "i32", "CHUNK": "i32", "S": "i32"}
        flags = {"HAS_DRAFT_PROBS": has_q, "FP64": dtype == "fp64", "BLOCK_K": 16, "BLOCK_V": 1024}
        signature = {**common, "num_accepted_ptr": "*i64", "res_part_ptr": "*fp64", "p_part_ptr": "*fp64", **sizes,
                     **dict.fromkeys(flags, "constexpr")}
        triton.compile(ASTSource(_split_mass_kernel, signature, flags), target=target, options=_OPTIONS)
        signature = {**common, "sample_u_ptr": u, "res_part_ptr": "*fp64", "p_part_ptr": "*fp64",
                     "next_tokens_ptr": "*i64", **sizes, **dict.fromkeys([*flags, "BLOCK_S"], "constexpr")}
        triton.compile(ASTSource(_split_sample_kernel, signature, {**flags, "BLOCK_S": 32}), target=target,
                       options=_OPTIONS)
        done.append(f"chain_verify_split[{dtype}, draft_probs={has_q}]")
        if has_q:  # the greedy kernels read no draft probabilities
            part = "*fp64" if dtype == "fp64" else "*fp32"
            signature = {"target_probs_ptr": _PTR[dtype], "max_part_ptr": part, "idx_part_ptr": "*i64",
                         "K": "i32", "V": "i32", "CHUNK": "i32", "S": "i32", "FP64": "constexpr",
                         "BLOCK_K": "constexpr", "BLOCK_V": "constexpr"}
            triton.compile(ASTSource(_split_argmax_kernel, signature, {"FP64": dtype == "fp64", "BLOCK_K": 16,
                                                                      "BLOCK_V": 512}), target=target, options=_OPTIONS)
            signature = {"draft_tokens_ptr": "*i64", "max_part_ptr": part, "idx_part_ptr": "*i64",
                         "num_accepted_ptr": "*i64", "next_tokens_ptr": "*i64", "K": "i32", "S": "i32",
                         "FP64": "constexpr", "BLOCK_K": "constexpr", "BLOCK_S": "constexpr"}
            triton.compile(ASTSource(_split_greedy_kernel, signature, {"FP64": dtype == "fp64", "BLOCK_K": 16,
                                                                      "BLOCK_S": 32}), target=target, options=_OPTIONS)
            done.append(f"chain_verify_split_greedy[{dtype}]")
    # Neighbourhood mass: every dtype x budget.
    for dtype, has_budget in itertools.product(_PTR, (True, False)):
        if not full and (dtype, has_budget) not in (("fp32", True), ("bf16", False), ("fp64", True)):
            continue
        out = "*fp64" if dtype == "fp64" else "*fp32"
        signature = {"probs_ptr": _PTR[dtype], "tokens_ptr": "*i64", "neighbors_ptr": "*i64",
                     "budget_ptr": out, "total_ptr": out, "prefix_ptr": out, "M": "i32", "V": "i32",
                     "k": "i32", "HAS_BUDGET": "constexpr", "ACC_DTYPE": "constexpr", "BLOCK_M": "constexpr",
                     "BLOCK_K": "constexpr"}
        constexprs = {"HAS_BUDGET": has_budget, "ACC_DTYPE": tl.float64 if dtype == "fp64" else tl.float32,
                      "BLOCK_M": 2, "BLOCK_K": 1024}
        triton.compile(ASTSource(_neighborhood_mass_kernel, signature, constexprs), target=target, options=_OPTIONS)
        done.append(f"neighborhood_mass[{dtype}, budget={has_budget}]")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90")
    parser.add_argument("--quick", action="store_true", help="a representative subset instead of all variants")
    args = parser.parse_args()
    names = compile_all(args.arch, full=not args.quick)
    print(f"compiled {len(names)} kernel variants for sm_{args.arch}")


if __name__ == "__main__":
    main()
