"""Every Triton kernel of the GPU set compiled for a GPU target without a GPU (`triton.compile` with
`GPUTarget`, the ptxas inside the triton wheel): errors only a GPU compile shows surface in CPU CI.

Run in a process without `TRITON_INTERPRET` (the interpreter's kernels are not compilable):
`python -m autobucket.engine.kernels.triton.ahead_of_time 80 90` prints one line per kernel and target."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from autobucket.engine.kernels.triton.tiles import (
    ATTENTION_BLOCK_N,
    ATTENTION_BLOCK_Q,
    LINEAR_TILES,
    ROW_BLOCK,
)

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kernel_specs() -> Iterator[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(label, kernel, signature, constexprs, options) for every kernel and dtype the GPU set launches."""
    from autobucket.engine.kernels.triton import (
        attention,
        linear,
        row_reductions,
        selection,
        shared_prefix_attention,
    )

    for dtype in (torch.float32, torch.bfloat16):
        t, tiles = _TYPES[dtype], LINEAR_TILES[dtype]
        yield f"linear[{t}]", linear.linear_kernel, {
            **dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "out_ptr"), f"*{t}"),
            **dict.fromkeys(("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om", "stride_on"), "i32"),
        }, {
            "HAS_BIAS": True, "FP32_INPUTS": dtype == torch.float32, "IN_ORDER": False,
            "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        }, {"num_warps": tiles.num_warps}  # fmt: skip
        yield f"attention[{t}]", attention.attention_kernel, {
            **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), f"*{t}"),
            "order_ptr": "*i32", "count_ptr": "*i32", "heads": "i32", "group": "i32", "queries": "i32", "head_dim": "i32",
            "scale": "fp32",
            **dict.fromkeys(
                ("sq_r", "sq_h", "sq_q", "sk_r", "sk_h", "sk_c", "sv_r", "sv_h", "sv_c", "so_r", "so_q", "so_h",
                 "sord_r", "sord_q", "sc_r", "sc_q"), "i32"),
        }, {"GATHER": True, "BLOCK_Q": ATTENTION_BLOCK_Q, "BLOCK_N": ATTENTION_BLOCK_N, "BLOCK_D": 64}, {"num_warps": 4}  # fmt: skip
        yield f"shared_prefix_attention[{t}]", shared_prefix_attention.shared_prefix_attention_kernel, {
            **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "sk_ptr", "sv_ptr", "out_ptr"), f"*{t}"),
            **dict.fromkeys(("order_ptr", "count_ptr", "prefix_ptr", "length_ptr"), "*i32"),
            **dict.fromkeys(("heads", "heads_per_kv", "queries", "head_dim"), "i32"), "scale": "fp32", "window": "i32",
            **dict.fromkeys(
                ("sq_r", "sq_h", "sq_q", "sk_r", "sk_h", "sk_c", "sv_r", "sv_h", "sv_c", "ssk_p", "ssk_h", "ssk_c",
                 "ssv_p", "ssv_h", "ssv_c", "so_r", "so_q", "so_h", "sord_r", "sord_q", "sc_r", "sc_q"), "i32"),
        }, {"GATHER": True, "WALK": 0, "BLOCK_Q": ATTENTION_BLOCK_Q, "BLOCK_N": ATTENTION_BLOCK_N, "BLOCK_D": 64}, {"num_warps": 4}  # fmt: skip
        yield f"rms_norm[{t}]", row_reductions.rms_norm_kernel, {
            "x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "width": "i32", "eps": "fp32",
            "stride_x": "i32", "stride_o": "i32",
        }, {"BLOCK": 1024}, {}  # fmt: skip
        yield f"logsumexp[{t}]", row_reductions.logsumexp_kernel, {
            "x_ptr": f"*{t}", "out_ptr": "*fp32", "width": "i32", "stride_x": "i32",
        }, {"BLOCK": ROW_BLOCK}, {}
        yield f"first_argmax[{t}]", selection.first_argmax_kernel, {
            "x_ptr": f"*{t}", "out_ptr": "*i64", "width": "i32", "stride_x": "i32",
        }, {"BLOCK": ROW_BLOCK}, {}
    yield "inverse_cdf[fp32]", selection.inverse_cdf_kernel, {
        "w_ptr": "*fp32", "u_ptr": "*fp32", "out_ptr": "*i64", "width": "i32", "stride_w": "i32",
    }, {"BLOCK": ROW_BLOCK}, {}


def compile_all(capability: int) -> list[tuple[str, int]]:
    """Compile every kernel for CUDA compute capability `capability` (80, 90) -> (label, cubin bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    built = []
    for label, kernel, signature, constexprs, options in kernel_specs():
        full_signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(kernel, full_signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
        built.append((label, len(compiled.asm["cubin"])))
    return built


def main(argv: list[str]) -> int:
    for capability in [int(a) for a in argv] or [80, 90]:
        for label, size in compile_all(capability):
            print(f"sm_{capability} {label} cubin {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
