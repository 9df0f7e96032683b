"""GPU tests of ``mhc_cupy.jax.mhc_stack`` (issue 44 items 1 and 3, JAX side): the CUDA kernels
through XLA's buffer_callback.

* stream recompute (L_r = 2, 3, "auto") gives the value and gradients (x, phi, alpha, bias) of the
  run without recompute bitwise, and both those of a loop of ``mhc_layer`` (all under ``jax.jit``),
  in bfloat16 and float32, both conventions; the sublayer's own weight gradient to XLA's
  per-program rounding (F_GRAD_TOL);
* float32: close to the float64 plain-jnp chain of tests/test_jax_stack.py, within the layer's
  GPU bound (harness.TOL["layer_gpu"], float32) per layer;
* fuse_boundaries=True (issue 44, "JAX: mhc_stack with fused boundaries"): without
  ``kernel_choice(boundary=True)`` the unfused stack's bits; with it, the boundary op's streams the
  post op's bits (the JAX op itself, and the recompute's rebuilt streams: gradients bitwise those
  without recompute), bitwise repeatable, and output and gradients close to the unfused stack's.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import TOL, assert_close

from .helpers import ACT_TOL, JAX_GPU


pytestmark = JAX_GPU

#: The sublayer's own weight gradient dW (the last of vjp_all's leaves) relative to max|dW|: XLA
#: compiles and autotunes the sublayer's reductions per program, so two programs (the stack with or
#: without recompute or fused boundaries, the loop) may sum dW over the tokens in different orders.  Seen on
#: the H200: 2.4e-7 of max|dW| at bfloat16, n 8, while out, dx, dphi, dalpha and dbias were bitwise.
F_GRAD_TOL = 1e-5


def sub_ew(w, h):
    """The sublayer of the tests that compare two programs bitwise: elementwise, weight w [C], so that its
    input gradient is the same in every program.  A matmul sublayer's is XLA's per program (the stack, the
    loop): seen on the H200, one unit of bfloat16 in the last layer's d layer_in at n 8 (deepseek), which
    then reached every earlier layer's gradients."""
    import jax.numpy as jnp

    return jnp.tanh(h.astype(jnp.float32) * w).astype(h.dtype)


def make_ew(rng, lead, n, C, L, dtype, convention):
    """test_jax_stack.make with sub_ew's weights W [L, C] (uniform in [0.5, 1.5])."""
    import jax.numpy as jnp
    import test_jax_stack as S

    params, x, g, _ = S.make(rng, lead, n, C, L, dtype, convention)
    return params, x, g, jnp.asarray(rng.uniform(0.5, 1.5, (L, C)), jnp.float32)


def same(got, want, what):
    """mhc_cupy's results bitwise (out and the gradients of params and x); the sublayer's dW to XLA's
    per-program rounding (F_GRAD_TOL)."""
    import test_jax_stack as S

    S.assert_same(got[:-1], want[:-1], what)
    w = np.asarray(want[-1], np.float64)
    np.testing.assert_allclose(np.asarray(got[-1], np.float64), w, rtol=0, atol=F_GRAD_TOL * np.abs(w).max(),
                               err_msg=f"{what}: dW")


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lead,n,C,L", [((4, 257), 4, 1024, 5), ((129,), 8, 96, 4), ((63,), 16, 40, 3)])
def test_gpu_stack_recompute_is_bitwise_no_recompute(lead, n, C, L, dtype, convention):
    import jax

    import mhc_cupy.jax as mj
    import test_jax_stack as S  # the CPU tests' helpers (tests/ is on sys.path: conftest.py)

    rng = np.random.default_rng(n * 1000 + C + L)
    params, x, g, W = make_ew(rng, lead, n, C, L, dtype, convention)
    args = jax.device_put((params, x, W), jax.devices("gpu")[0])
    want = S.vjp_all(lambda p, x, W: S.loop(p, x, sub_ew, W, convention=convention), args, g)
    assert want[0].devices() == {jax.devices("gpu")[0]}
    for recompute in (None, 2, 3, "auto"):
        got = S.vjp_all(lambda p, x, W: mj.mhc_stack(p, x, sub_ew, W, recompute=recompute, convention=convention),
                        args, g)
        same(got, want, f"recompute={recompute!r}")
        assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_gpu_stack_matches_a_float64_chain(convention):
    import jax
    import jax.numpy as jnp

    import mhc_cupy.jax as mj
    import test_jax_stack as S

    lead, n, C, L = (127,), 4, 96, 4
    rng = np.random.default_rng(7)
    params, x, g, W = S.make(rng, lead, n, C, L, "float32", convention)
    with jax.default_matmul_precision("highest"):  # no TF32 in the sublayer's matmul
        got = S.vjp_all(lambda p, x, W: mj.mhc_stack(p, x, S.sub, W, recompute="auto", convention=convention),
                        jax.device_put((params, x, W), jax.devices("gpu")[0]), g)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        def chain(p, x, W):
            for l in range(L):
                x = S._ref_layer(jax.tree.map(lambda a: a[l], p), x, W[l], convention)
            return x

        def as64(t):
            return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), t)

        out, vjp = jax.vjp(chain, *as64((params, x, W)))
        want = [np.asarray(a) for a in (out, *jax.tree_util.tree_leaves(vjp(as64(g))))]
    tol = TOL["layer_gpu"]["float32"][1] * L
    for name, a, w in zip(("out", "dalpha", "dbias", "dphi", "dx", "dW"), got, want):
        assert_close(a, w, tol, name)


#: fused vs unfused stack on the GPU, relative to max|unfused| (assert_close scale="max"): the next
#: layer's coefficients differ in the last float32 bits (other channel ranges of the sums), which
#: can flip a rounding of layer_in and so of the streams (bfloat16: one unit 2^-8 of an element) and
#: propagate through the later layers; the bounds of the torch stack's GPU test of the same op
#: (tests/test_stack.py, test_gpu_fused_boundaries_match_the_chain), not tightened without a GPU run.
FUSED_TOL = {"bfloat16": 3e-2, "float32": 1e-4}


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lead,n,C,L", [((4, 257), 4, 1024, 4), ((129,), 6, 64, 3), ((8,), 2, 24, 3),
                                        ((63,), 8, 40, 3), ((33,), 4, 7, 2)])
def test_gpu_stack_fused_boundaries(lead, n, C, L, dtype, convention):
    """n <= 6 with C % 8 == 0 takes the fused kernel under kernel_choice(boundary=True); n = 8 and
    C = 7 fall back to the two ops' kernels (then bitwise the unfused stack either way)."""
    import jax

    import mhc_cupy.jax as mj
    from mhc_cupy._convention import DEFAULT
    from mhc_cupy._kernel_choice import kernel_choice
    from mhc_cupy.ops.boundary import boundary_layout
    import test_jax_stack as S

    rng = np.random.default_rng(n * 1000 + C + L)
    params, x, g, W = make_ew(rng, lead, n, C, L, dtype, convention)
    args = jax.device_put((params, x, W), jax.devices("gpu")[0])

    def run(fuse, recompute=None):  # traced (and planned) afresh under the kernel choice in force
        return S.vjp_all(lambda p, x, W: mj.mhc_stack(p, x, sub_ew, W, recompute=recompute, fuse_boundaries=fuse,
                                                      convention=convention), args, g)

    with jax.default_matmul_precision("highest"):  # no TF32 in the sublayer: its inputs differ slightly
        want = run(False)
        for recompute in (None, 2):
            same(run(True, recompute), want, f"the kernel off: the unfused bits, recompute={recompute!r}")
        with kernel_choice(boundary=True):  # (off by default: slower than the two ops on the H200)
            got = run(True)
            same(run(True), got, "repeatable")
            same(run(True, 2), got, "recompute: the rebuilt streams are the boundary's")
            same(run(True, "auto"), got, "recompute auto")
            # the JAX op itself on layer 0's pieces: out has the post op's bits
            settings = mj._layer_settings(DEFAULT, DEFAULT, DEFAULT, "unrolled", convention)
            p0, p1 = (jax.tree.map(lambda a: a[i], args[0]) for i in (0, 1))
            pre = mj._layer_pre(settings, args[1], p0["phi"], p0["alpha"], p0["bias"])
            y = sub_ew(args[2][0], pre[0])
            fused = jax.jit(lambda *a: mj._k("mhc_boundary_fwd", (("settings", settings),), *a))(
                y, args[1], pre[2], pre[3], p1["phi"], p1["alpha"], p1["bias"])
            post = mj.mhc_post_op(y, args[1], pre[2], pre[3], convention=convention)
            S.assert_same(fused[:1], [post], "the boundary's streams")
            # the next layer's pieces: as the separate op's, to float32 rounding of the coefficient sums
            # (the bounds of tests/gpu/test_boundary_gpu.py)
            sep = mj._layer_pre(settings, post, p1["phi"], p1["alpha"], p1["bias"])
            assert_close(fused[1], sep[0], ACT_TOL[dtype], "layer_in")
            for a, b, what in zip(fused[2:5], sep[1:4], ("H_pre", "H_post", "H_res")):
                assert_close(a, b, 2e-4, what)
            assert_close(fused[5], sep[4], 1e-4, "stats", scale="max")
    if boundary_layout(int(np.prod(lead)), n, C) is None:
        same(got, want, "no fused kernel for this shape: the unfused bits")
    for a, b, what in zip(got, want, ("out", "dalpha", "dbias", "dphi", "dx", "dW")):
        assert np.isfinite(np.asarray(a, np.float32)).all(), what
        assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), FUSED_TOL[dtype], what, scale="max")


@pytest.mark.parametrize("convention", ["paper", "deepseek"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lead,n,C,L", [((4, 257), 4, 1024, 5), ((129,), 2, 96, 4), ((63,), 3, 40, 3)])
def test_gpu_stack_fused_boundary_backward_is_bitwise_unfused(lead, n, C, L, dtype, convention):
    """kernel_choice(boundary_bwd=True) (OPS.md section 12, "Fused boundary backward"; n <= 4): inside
    the recompute blocks each layer's dy comes from the next layer's dx kernel and the post op's
    coefficient gradients from the pre piece's merged pass: bitwise the same stack without it."""
    import jax

    import mhc_cupy.jax as mj
    import test_jax_stack as S
    from mhc_cupy._kernel_choice import kernel_choice

    rng = np.random.default_rng(n * 1000 + C + L + 7)
    params, x, g, W = make_ew(rng, lead, n, C, L, dtype, convention)
    args = jax.device_put((params, x, W), jax.devices("gpu")[0])
    for recompute in (None, 2, "auto", L):
        fn = lambda p, x, W: mj.mhc_stack(p, x, sub_ew, W, recompute=recompute, fuse_boundaries=True,  # noqa: E731
                                          convention=convention)
        want = S.vjp_all(fn, args, g)
        with kernel_choice(boundary_bwd=True):
            got = S.vjp_all(fn, args, g)
        same(got, want, f"recompute={recompute!r}")
