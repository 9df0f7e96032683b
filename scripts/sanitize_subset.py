"""A representative subset of every op, forward and backward, for compute-sanitizer.

Shapes cover: odd C (scalar path, misaligned rows), C split into 3 / 5 / 7
block-sized chunks, the vectorised path, n = 1, 3, 4, 8, 16, 17, 32, shared
coefficients, RMSNorm with a weight and on vec(x), Sinkhorn history in shared and in global
memory (n = 17: lanes that own fewer columns than rows), both gradient modes (n = 32: the
warp-per-matrix implicit backward), the fused layer pieces (tensor-core forward for every n; the
fused backward for n <= 4, the dphi / dx kernels above, the dx with phi resident for n = 8 and streamed
(mhc_coeffs_mma_dx_tile_kernel) for n = 16, 17 and 32 (bf16 n = 16: two streams a block, C = 72
ends in a partial column tile);
the post op's dx given as g or as grad_x; on sm_90 the wgmma forward GEMM for bf16 at n = 8, 16, 17 and,
element-wise fills, n = 7 with C = 13, and the wgmma dx for bf16 at n = 7 and 8 (65 tokens: a partial
64-token tile; C = 24: D not a multiple of a block's 128 positions)); the kernels that are off by
default, each under its own kernel choice: the fused boundary (mhc_boundary_fwd_kernel, n <= 6 with
C % 8 == 0; 65 tokens: a partial 64-token tile; with the tail after it too), the small-token forward (the
GEMV and the pre piece's tail kernel, every case here has <= 65 tokens; the boundary op's GEMV with the
residual update), the tail kernel after the tensor-core GEMM (kernel choice tail), layer_in for the next
GEMM (mhc_layer_pre_norm_fwd, mhc_layer_pre_fp8_fwd; after the small path's and the tail's kernels too) and
the fused boundary backward (mhc_boundary_bwd, mhc_layer_pre_bwd with layer_out), the post backward's
cp.async ring (kernel choice post_pipe).  Exits non-zero if any result is not finite.

    python scripts/sanitize_subset.py [--opt-in]

``--opt-in``: only the kernels that are off by default (those under a kernel choice below, on the
same shapes, after the layer's forward and post backward that they take their inputs from): a short
run for a device session with little time.
"""

import sys

import cupy as cp

import mhc_cupy as m
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops import rmsnorm

rng = cp.random.default_rng(0)
bad = []
if sys.argv[1:] not in ([], ["--opt-in"]):
    raise SystemExit(f"usage: python scripts/sanitize_subset.py [--opt-in]; got {' '.join(sys.argv[1:])}")
OPT_IN = sys.argv[1:] == ["--opt-in"]


def act(*s, dt=cp.float32):
    return rng.standard_normal(s, dtype=cp.float32).astype(dt)


def check(name, *arrays):
    for a in arrays:
        if not bool(cp.isfinite(a.astype(cp.float32)).all()):
            bad.append(name)


bf16 = m._interop.numpy_dtype("bfloat16")
for T, n, C, dt in [(3, 3, 13, bf16), (5, 4, 1536, bf16), (2, 4, 2560, bf16), (2, 8, 7168, cp.float32),
                    (17, 8, 100, bf16), (4, 1, 4095, cp.float16), (2, 16, 72, bf16), (2, 17, 264, bf16),
                    (3, 32, 40, cp.float32), (3, 7, 13, bf16), (65, 8, 64, bf16), (65, 7, 24, bf16),
                    (65, 5, 200, cp.float16)]:
    x, y, g, gy = act(T, n, C, dt=dt), act(T, C, dt=dt), act(T, n, C, dt=dt), act(T, C, dt=dt)
    M, h, hs = act(T, n, n), act(T, n), act(n)
    if not OPT_IN:  # the default kernels
        check("mix", m.stream_mix_fwd(x, M), *m.stream_mix_bwd(g, x, M))
        check("post", m.mhc_post_op_fwd(y, x, h, M), *m.mhc_post_op_bwd(g, y, x, h, M))
        for hh in (h, hs):
            check("aggregate", m.stream_aggregate_fwd(x, hh), *m.stream_aggregate_bwd(gy, x, hh))
            check("distribute", m.stream_distribute_fwd(y, hh), *m.stream_distribute_bwd(g, y, hh))
        w = act(C)
        check("rmsnorm", m.rmsnorm_fwd(y, 1e-5, w), *m.rmsnorm_bwd(gy, y, 1e-5, w), m.rmsnorm_bwd(gy, y))
        # vec(x): the register-cached kernels with K > 1 (6144); rows of 1024 vectors or more (4095, 10240,
        # 57344) the two-pass kernels at up to 1024 threads; the weighted backward where its dw row fits every
        # supported GPU
        xv, gv = x.reshape(T, n * C), g.reshape(T, n * C)
        check("rmsnorm vec(x)", m.rmsnorm_fwd(xv), m.rmsnorm_bwd(gv, xv))
        if n * C <= rmsnorm.WEIGHTED_C_EVERYWHERE:
            check("rmsnorm vec(x) weighted", *m.rmsnorm_bwd(gv, xv, 1e-5, act(n * C)))
        check("pre", *m.mhc_pre_op_fwd(x, h, h, M), *m.mhc_pre_op_bwd(gy, h, h, M, x, h, h, M))
        check("pre implicit", *m.mhc_pre_op_bwd(None, None, h, M, x, h, h, M, grad_mode="implicit"))
    K = n * n + 2 * n
    phi, alpha, bias = act(n * C, K) * 0.01, act(3), act(K)
    hr = act(T, n, n)
    layer_in, H_pre, H_post, H_res, stats = m.mhc_layer_pre_fwd(x, phi, alpha, bias)
    dy, dH_post, dH_res = m.mhc_layer_post_bwd(g, y, x, H_post, H_res)
    check("layer", layer_in, stats, dy, dH_post, dH_res)
    if not OPT_IN:
        check("coeffs", *m.mhc_coeffs_fwd(x, phi, alpha, bias), *m.mhc_coeffs_bwd(h, None, hr, x, phi, alpha, bias))
        check("layer bwd", *m.mhc_layer_pre_bwd(gy.astype(g.dtype), g, dH_post, dH_res, x, phi, alpha, bias, stats,
                                                H_pre, H_res))
        _, dx_post, _, _ = m.mhc_post_op_bwd(g, y, x, H_post, H_res)  # the adapters' form for n > 4: grad_x
        check("layer bwd grad_x", *m.mhc_layer_pre_bwd(gy.astype(g.dtype), None, dH_post, dH_res, x, phi, alpha, bias,
                                                       stats, H_pre, H_res, grad_x=dx_post.astype(g.dtype)))
    with kernel_choice(boundary=True):  # (alone: under small the GEMV takes every case of <= 64 tokens)
        check("boundary", *m.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias))
        with kernel_choice(tail=True):
            check("boundary deepseek tail",
                  *m.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias, convention="deepseek"))
    with kernel_choice(small=True):
        check("small layer", *m.mhc_layer_pre_fwd(x, phi, alpha, bias), *m.mhc_coeffs_fwd(x, phi, alpha, bias),
              *m.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias))
    with kernel_choice(tail=True):  # the one-launch tail after the tensor-core GEMM (off by default)
        check("tail layer", *m.mhc_layer_pre_fwd(x, phi, alpha, bias),
              *m.mhc_boundary_fwd(y, x, H_post, H_res, phi, alpha, bias, convention="deepseek"))
    with kernel_choice(boundary_bwd=True):  # the fused boundary backward (off by default)
        g_li = gy.astype(g.dtype)
        check("boundary bwd", *m.mhc_boundary_bwd(g_li, g, None, None, x, phi, alpha, bias, stats, H_pre, H_res, y,
                                                  H_post))
        check("layer bwd layer_out", *m.mhc_layer_pre_bwd(g_li, g, dH_post, None, x, phi, alpha, bias, stats, H_pre,
                                                          H_res, layer_out=y, convention="deepseek"))
    with kernel_choice(post_pipe=True):  # the post backward's cp.async ring (off by default; n <= 4, 16-bit)
        check("post bwd pipe", *m.mhc_layer_post_bwd(g, y, x, H_post, H_res),
              *m.mhc_post_op_bwd(g, y, x, H_post, H_res, convention="deepseek"))
    with kernel_choice(layer_in=True):  # layer_in for the next GEMM (off by default)
        w = act(C)
        check("layer_in norm", *m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w))
        check("layer_in fp8", *m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias, w)[1:])  # (float8 bits: uint8)
        with kernel_choice(small=True):
            check("layer_in fp8 small", *m.mhc_layer_pre_fp8_fwd(x, phi, alpha, bias)[1:])
        with kernel_choice(tail=True):
            check("layer_in norm tail", *m.mhc_layer_pre_norm_fwd(x, phi, alpha, bias, w))
    for iters in (() if OPT_IN else (20, 200)):
        check("sinkhorn", m.sinkhorn_knopp_fwd(M, iters), m.sinkhorn_knopp_bwd(M, M, iters))
        check("sinkhorn deepseek", m.sinkhorn_knopp_bwd(M, M, iters, convention="deepseek"))
cp.cuda.Device().synchronize()
print("sanitize subset:", "FAILED " + ", ".join(bad) if bad else "all outputs finite")
raise SystemExit(1 if bad else 0)
