"""Size limits of the GPU kernels, checked by the planners before anything is
allocated (no GPU needed), and per-thread resources of the compiled kernels
(NVRTC only).

* Every kernel takes the row length C as a 32-bit int: C >= 2^31 is a clear
  ValueError naming the argument (it used to be an OverflowError at launch,
  after the outputs were allocated).  The inputs here are zero-stride NumPy
  views: 2^31 elements that take no memory.
* The coefficient path indexes positions of vec(x) (n * C of them) in 32 bits:
  n * C > 2^30 is refused.
* The weighted rmsnorm_bwd keeps a float32 row of C in shared memory: its C
  limit is the device's opt-in shared memory per block minus the kernels'
  static shared memory (not Hopper's 227 KiB everywhere).
* The implicit Sinkhorn backward at n = 32 needs no stack (it kept 12.9 KB per
  thread in local memory).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import _checks, _kernels, _nvrtc
from mhc_cupy.ops import rmsnorm

BIG = 2**31
BF16 = np.dtype(ml_dtypes.bfloat16)


def _huge(shape, dtype=np.float32):
    """A read-only array of ``shape`` backed by one element."""
    return np.broadcast_to(np.zeros((1,) * len(shape), dtype), shape)


def _coef(shape):
    return np.zeros(shape, np.float32)


C_CASES = {
    "rmsnorm_fwd": lambda C: m.rmsnorm_fwd(_huge((1, C), BF16)),
    "rmsnorm_bwd": lambda C: m.rmsnorm_bwd(_huge((1, C), BF16), _huge((1, C), BF16)),
    "rmsnorm_bwd weighted": lambda C: m.rmsnorm_bwd(_huge((1, C), BF16), _huge((1, C), BF16), 1e-5, _huge((C,))),
    "stream_mix_fwd": lambda C: m.stream_mix_fwd(_huge((1, 1, C)), _coef((1, 1, 1))),
    "stream_mix_bwd": lambda C: m.stream_mix_bwd(_huge((1, 1, C)), _huge((1, 1, C)), _coef((1, 1, 1))),
    "stream_aggregate_fwd": lambda C: m.stream_aggregate_fwd(_huge((1, 2, C)), _coef((1, 2))),
    "stream_aggregate_bwd": lambda C: m.stream_aggregate_bwd(_huge((1, C)), _huge((1, 2, C)), _coef((1, 2))),
    "stream_distribute_fwd": lambda C: m.stream_distribute_fwd(_huge((1, C)), _coef((2,))),
    "stream_distribute_bwd": lambda C: m.stream_distribute_bwd(_huge((1, 2, C)), _huge((1, C)), _coef((2,))),
    "mhc_post_op_fwd": lambda C: m.mhc_post_op_fwd(_huge((1, C)), _huge((1, 2, C)), _coef((1, 2)), _coef((1, 2, 2))),
    "mhc_pre_op_fwd": lambda C: m.mhc_pre_op_fwd(_huge((1, 2, C)), _coef((1, 2)), _coef((1, 2)), _coef((1, 2, 2))),
}


@pytest.mark.parametrize("op", sorted(C_CASES))
@pytest.mark.parametrize("C", [BIG, 2**40])
def test_row_length_above_int32_is_a_value_error(op, C):
    with pytest.raises(ValueError, match=r"C = \d+ exceeds the supported maximum 2\^31 - 1"):
        C_CASES[op](C)


def test_row_length_limit_is_inclusive():
    info = m._interop.ArrayInfo((3, BIG - 1), "bfloat16", ("cuda", 0))
    assert _checks.row_length("x", info) == BIG - 1
    with pytest.raises(ValueError, match=r"x has shape \(3, 2147483648\)"):
        _checks.row_length("x", info._replace(shape=(3, BIG)))


@pytest.mark.parametrize("n,C", [(1, 2**30 + 1), (4, 2**28 + 1), (2, 2**30)])
def test_coeffs_vec_length_limit(n, C):
    x = _huge((1, n, C))
    K = n * n + 2 * n
    with pytest.raises(ValueError, match=r"n \* C = \d+ exceeds the supported maximum 2\^30"):
        m.mhc_coeffs_fwd(x, _coef((1, K)), _coef((3,)), _coef((K,)))
    with pytest.raises(ValueError, match=r"n \* C = \d+ exceeds the supported maximum 2\^30"):
        m.mhc_coeffs_bwd(None, None, None, x, _coef((1, K)), _coef((3,)), _coef((K,)))


# ------------------------------------------------------ weighted rmsnorm_bwd
# cudaDevAttrMaxSharedMemoryPerBlockOptin of sm_90 (H100 / H200), sm_80 (A100), sm_86 / sm_89
OPTIN = {"sm_90": 232448, "sm_80": 166912, "sm_86": 101376}
LIMIT = {"sm_90": 58048, "sm_80": 41664, "sm_86": 25280}


def test_weighted_c_everywhere_is_the_least_limit():
    """The C that CI's kernel set and the sanitizer subset run weighted on every GPU."""
    assert rmsnorm.WEIGHTED_C_EVERYWHERE == min(LIMIT.values())


@pytest.mark.parametrize("arch", sorted(OPTIN))
def test_weighted_rmsnorm_bwd_c_limit_follows_the_device(monkeypatch, arch):
    monkeypatch.setattr(rmsnorm, "_smem_optin", lambda ordinal: OPTIN[arch])
    dev = ("cuda", 1)
    assert LIMIT[arch] == (OPTIN[arch] - 256) // 4
    rmsnorm.check_weighted_c(LIMIT[arch], dev)
    with pytest.raises(ValueError, match=rf"supports C <= {LIMIT[arch]}; x has C = {LIMIT[arch] + 1} .*"
                                         rf"{OPTIN[arch]} bytes per block on cuda:1, 256 of them static"):
        rmsnorm.check_weighted_c(LIMIT[arch] + 1, dev)
    # through the planner (a GPU ArrayInfo: nothing is allocated or launched)
    C = LIMIT[arch] + 1
    info = m._interop.ArrayInfo((2, C), "bfloat16", dev, 1 << 20, (C, 1))
    w = m._interop.ArrayInfo((C,), "float32", dev, 1 << 20, (1,))
    params = m.ops.SPECS["rmsnorm_bwd"].params  # whatever parameters rmsnorm takes, at their defaults
    with pytest.raises(ValueError, match=rf"supports C <= {LIMIT[arch]}"):
        rmsnorm._plan_bwd({"grad": info, "x": info, "weight": w}, **params)
    rmsnorm._plan_bwd({"grad": info, "x": info, "weight": None}, **params)  # no weight: no shared row


def test_weighted_rmsnorm_bwd_c_limit_without_a_device_query(monkeypatch):
    monkeypatch.setattr(rmsnorm, "_smem_optin", lambda ordinal: pytest.fail("queried a device"))
    rmsnorm.check_weighted_c(BIG - 1, ("cpu", 0))  # the CPU reference: no limit (OPS.md section 2)
    rmsnorm.check_weighted_c(12000, ("cuda", 0))  # within the 48 KiB every GPU grants: no query
    monkeypatch.setattr(rmsnorm, "_smem_optin", lambda ordinal: None)
    rmsnorm.check_weighted_c(LIMIT["sm_90"], ("cuda", 0))  # cannot query (no GPU here): the H100 / H200 limit
    with pytest.raises(ValueError, match=rf"supports C <= {LIMIT['sm_90']}"):
        rmsnorm.check_weighted_c(LIMIT["sm_90"] + 1, ("cuda", 0))


def test_weighted_rmsnorm_bwd_on_the_cpu_past_the_gpu_limit(rng):
    """The CPU reference takes any C (OPS.md section 2): C one past the H100 / H200 limit, against
    a float64 evaluation of the same formulas, through the functional API and torch autograd."""
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt

    C = LIMIT["sm_90"] + 1
    x = rng.standard_normal((2, C)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    g = rng.standard_normal((2, C)).astype(np.float32)
    dx, dw = m.rmsnorm_bwd(g, x, weight=w)
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
    r = 1 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5)
    gw = g64 * w64
    np.testing.assert_allclose(dx, r * gw - x64 * r**3 * (gw * x64).mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, (g64 * x64 * r).sum(0), rtol=1e-5, atol=1e-6)
    xt, wt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    gx, gw_t = torch.autograd.grad(mt.rmsnorm(xt, weight=wt), (xt, wt), torch.from_numpy(g))
    np.testing.assert_array_equal(gx.numpy(), dx)
    np.testing.assert_array_equal(gw_t.numpy(), dw)


@pytest.mark.gpu
def test_torch_weighted_rmsnorm_refuses_c_in_forward(monkeypatch):
    """On a GPU, mhc_cupy.torch.rmsnorm with a weight refuses a C its backward cannot take in
    the forward (when gradients are recorded), not after the forward ran; without recording,
    the forward runs.  The device's limit is lowered to 14936 (60000 bytes of shared memory)."""
    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt

    monkeypatch.setattr(rmsnorm, "_smem_optin", lambda ordinal: 60000)
    C = 16000
    x = torch.randn(2, C, device="cuda")
    w = torch.ones(C, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match=r"rmsnorm_bwd with a weight supports C <= 14936; x has C = 16000"):
        mt.rmsnorm(x, weight=w)
    with torch.no_grad():
        assert mt.rmsnorm(x, weight=w).shape == (2, C)


# ------------------------------------------------- per-thread kernel resources
def _nvrtc_or_skip():
    try:
        return _nvrtc.version()
    except _nvrtc.NVRTCNotFoundError as exc:
        pytest.skip(f"libnvrtc not available: {exc}")


def _stack_frames(fname: str, exprs: list, arch: str) -> dict:
    """{name expression: bytes of stack frame} from ptxas's verbose output."""
    from mhc_cupy._jit import NVRTC_OPTIONS
    from mhc_cupy._sources import load_source

    options = [o for o in NVRTC_OPTIONS if not o.startswith(("-arch", "--gpu-architecture", "--gpu-name"))]
    res = _nvrtc.compile(load_source(fname), fname, exprs, arch=arch, options=options + ["--ptxas-options=-v"])
    by_mangled = {v: k for k, v in res["lowered_names"].items()}
    frames, current = {}, None
    for line in res["log"].splitlines():
        for mangled, expr in by_mangled.items():
            if f"'{mangled}'" in line or f" {mangled} " in line or line.rstrip().endswith(mangled):
                current = expr
        hit = re.search(r"(\d+) bytes stack frame", line)
        if hit and current is not None:
            frames[current] = int(hit.group(1))
            current = None
    return frames


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sinkhorn_backward_needs_no_stack_at_n32(arch):
    _nvrtc_or_skip()
    specs = _kernels.specialisations(dtypes=("float32",), ns=(32,), Cs=(64,), aligned=(True,), grad_f32=(False,))
    exprs = sorted(e for f, e in specs if f == "sinkhorn.cu" and "bwd" in e)
    assert any("implicit" in e for e in exprs), exprs
    frames = _stack_frames("sinkhorn.cu", exprs, arch)
    assert set(frames) == set(exprs), f"no ptxas report for {set(exprs) - set(frames)}"
    assert all(v == 0 for v in frames.values()), frames
