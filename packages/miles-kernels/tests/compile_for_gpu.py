"""Compile every Triton kernel of miles_kernels.triton_ops ahead of time for a GPU target (no GPU needed: Triton
lowers to PTX and runs its bundled ptxas), in float32 and bfloat16: what the interpreter cannot check (the
compiler's typing of loop-carried values, pointer casts, dot shapes). Run by test_triton_ops.py in a process of its
own, without TRITON_INTERPRET (an interpreted kernel cannot be compiled).

    python packages/miles-kernels/tests/compile_for_gpu.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from miles_kernels.triton_ops import attention, grouped, logsoftmax, matmul, norm, sampling


def kernels(dtype: str) -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """(name, kernel, signature, constexprs) of every kernel, its tensors of `dtype` where the caller's are."""
    ptr, i32, f32 = f"*{dtype}", "i32", "fp32"
    tiles = {"BLOCK_M": 16, "BLOCK_N": matmul.BLOCK_N, "BLOCK_K": matmul.BLOCK_K, "UPCAST": False}
    attention_sizes = {"G": 4, "BLOCK_G": 16, "P": 16, "D": 128, "BLOCK_D": 128, "SPLIT_BLOCKS": 64}
    return [
        ("matmul", matmul._matmul_kernel,
         {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "M": i32, "N": i32, "K": i32, "stride_xm": i32,
          "stride_xk": i32, "stride_wn": i32, "stride_wk": i32, "stride_om": i32, "stride_on": i32},
         {"NUM_PROGRAMS": 132, **tiles}),
        ("grouped", grouped._grouped_kernel,
         {"x_ptr": ptr, "weight_table": "*i64", "tiles_ptr": "*i32", "out_ptr": ptr, "num_tiles": i32, "N": i32,
          "K": i32, "stride_xm": i32, "stride_wn": i32, "stride_om": i32},
         {"NUM_PROGRAMS": 132, **tiles}),
        ("rms_norm", norm._rms_norm_kernel,
         {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "H": i32, "stride_x": i32, "stride_out": i32, "eps": f32},
         {"BLOCK": 1024}),
        ("logsumexp", logsoftmax._logsumexp_kernel,
         {"logits_ptr": ptr, "temperature_ptr": "*fp32", "token_ptr": "*i64", "lse_ptr": "*fp32",
          "token_logprob_ptr": "*fp32", "V": i32, "stride_row": i32},
         {"HAS_TOKENS": True, "BLOCK": 1024}),
        ("gumbel_argmax", sampling._gumbel_argmax_kernel,
         {"logits_ptr": ptr, "keys_ptr": "*i64", "temperatures_ptr": "*fp64", "out_ptr": "*i64", "V": i32,
          "stride_row": i32},
         {"BLOCK": 1024}),
        ("attention", attention._attention_kernel,
         {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
          "part_acc_ptr": "*fp32", "positions_ptr": "*i64", "seqs_ptr": "*i64", "tables_ptr": "*i64",
          "stride_qn": i32, "stride_qh": i32, "stride_kp": i32, "stride_kh": i32, "stride_ko": i32, "stride_on": i32,
          "stride_oh": i32, "stride_table": i32, "max_splits": i32, "scale": f32, "window": i32},
         {**attention_sizes, "HAS_WINDOW": True}),
        ("attention_combine", attention._combine_kernel,
         {"out_ptr": ptr, "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32",
          "positions_ptr": "*i64", "stride_on": i32, "stride_oh": i32, "max_splits": i32},
         attention_sizes),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100 / H200)")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for dtype in ("fp32", "bf16"):
        for name, kernel, signature, constexprs in kernels(dtype):
            source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                               constexprs=constexprs)  # fmt: skip
            compiled = triton.compile(source, target=target)
            print(f"{name} {dtype}: sm_{args.arch} cubin {len(compiled.asm['cubin'])} bytes", flush=True)


if __name__ == "__main__":
    main()
