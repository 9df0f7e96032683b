"""The post op's backward with its loads pipelined through cp.async (kernel choice post_pipe, off by default
until this passes on a GPU and bench shows it faster: mhc_stream_mix_distribute_bwd_kernel with STAGES):
mhc_layer_post_bwd and mhc_post_op_bwd bitwise the default kernel (the same arithmetic per thread), on
NaN-poisoned outputs, every n it takes (1..4), both conventions, several tokens a block (grid smaller than
the tokens), and close to the float64 reference; the cases it does not take (float32, odd C) run the default kernel."""

from __future__ import annotations

import numpy as np
import pytest

import mhc_cupy as m
from mhc_cupy import reference as R
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.ops import _launch, stream as ops_stream

from .helpers import ACT_TOL, COEF_TOL, assert_close, coef, poisoned_allocations, rounded, to_gpu, to_host

pytestmark = pytest.mark.gpu


def _case(rng, T, n, C, dt):
    return (rounded(rng, (T, n, C), dt), rounded(rng, (T, C), dt), rounded(rng, (T, n, C), dt),
            coef(rng, (T, n)), coef(rng, (T, n, n), 1.0 / n))


def _pipelined(expr: str) -> bool:
    """The launch is the post backward with its STAGES template argument (the 8th)."""
    return expr.startswith("mhc_stream_mix_distribute_bwd_kernel<") and expr.count(",") == 7


def _launched(f):
    """f()'s result and the kernels it launched (ops.stream launches through the ``launch`` it imported from
    ops._launch at import, not through the _jit module attribute: spy there)."""
    names = []
    launch = ops_stream.launch

    def spy(filename, expr, *a, **k):
        names.append(expr)
        return launch(filename, expr, *a, **k)

    ops_stream.launch = spy
    try:
        out = f()
    finally:
        ops_stream.launch = launch
    return out, names


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("T,C", [(1, 2048), (3, 7168), (127, 512), (1000, 2056), (7, 13), (2, 8)])
@pytest.mark.parametrize("convention", ["paper", "deepseek"])
def test_pipelined_post_backward_is_bitwise_the_default(rng, dt, n, T, C, convention, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_GRID", 5)  # (read by grid_for at launch: blocks walk several tokens)
    monkeypatch.setattr(m._dispatch, "_fast", {})  # (no launches recorded under another grid)
    g, y, x, H_post, H_res = (to_gpu(a) for a in _case(rng, T, n, C, dt))
    ops = (("mhc_layer_post_bwd", lambda: m.mhc_layer_post_bwd(g, y, x, H_post, H_res, convention=convention)),
           ("mhc_post_op_bwd", lambda: m.mhc_post_op_bwd(g, y, x, H_post, H_res, convention=convention)))
    takes = dt != "float32" and C % 8 == 0
    for name, f in ops:
        with poisoned_allocations():
            base, names0 = _launched(f)
            with kernel_choice(post_pipe=True):
                got, names1 = _launched(f)
                again = f()
        assert not any(map(_pipelined, names0))
        assert any(map(_pipelined, names1)) == takes, names1
        for a, b, c in zip(base, got, again):
            assert np.array_equal(to_host(a).view(np.uint8), to_host(b).view(np.uint8)), name
            assert np.array_equal(to_host(b).view(np.uint8), to_host(c).view(np.uint8)), name
        ref = R.mhc_post_op_bwd(*(to_host(a) for a in (g, y, x, H_post, H_res)), convention)
        assert_close(to_host(got[0]), ref[0], ACT_TOL[dt], f"{name} dy")
        assert_close(to_host(got[-2]), ref[2], COEF_TOL, f"{name} dH_post")
        assert_close(to_host(got[-1]), ref[3], COEF_TOL, f"{name} dH_res")
