"""The kernel choice (``mhc_cupy._kernel_choice``), CPU only: the value and its scope, that it changes
what a plan launches (plans run under ``_jit.dry_run``, as on a device with wgmma), that the plan caches
of the functional API (plans and fast-path entries) and of the JAX adapter key on it, and that MHC reads
``fused`` when it is built."""

from __future__ import annotations

import functools

import pytest

from mhc_cupy import _dispatch, _jit
from mhc_cupy._interop import ArrayInfo
from mhc_cupy._kernel_choice import LIBRARY_CHOICE, KernelChoice, current, kernel_choice
from mhc_cupy.ops import coeffs
from mhc_cupy.ops import layer as L


# ------------------------------------------------------------------ the value
def test_choice_value_and_scope():
    assert current() == KernelChoice() and all(KernelChoice().runs(v) == LIBRARY_CHOICE[v] for v in LIBRARY_CHOICE)
    assert not KernelChoice().runs("boundary") and KernelChoice(boundary=True).runs("boundary")  # until GPU-checked
    assert not KernelChoice(wg_dx=False).runs("wg_dx") and KernelChoice(wg_dx=False).runs("wg_fwd")
    with kernel_choice(wg_fwd=False) as outer:
        assert current() is outer and outer == KernelChoice(wg_fwd=False)
        with kernel_choice(fused=False):  # the one in force, one more variant replaced
            assert current() == KernelChoice(wg_fwd=False, fused=False)
        with kernel_choice(KernelChoice(wg_dx=False)):  # a whole choice replaces it
            assert current() == KernelChoice(wg_dx=False)
        assert current() == outer
    assert current() == KernelChoice()
    with pytest.raises(TypeError, match="KernelChoice.wg_fwd must be True, False or None"):
        KernelChoice(wg_fwd=0)
    with pytest.raises(TypeError):
        with kernel_choice(wgmma=False):  # not a variant
            pass
    with pytest.raises(TypeError, match="choice must be a KernelChoice"):
        with kernel_choice({"fused": False}):
            pass
    assert current() == KernelChoice()


# ------------------------------------------------------------------ what a plan launches
def _info(shape, dtype="float32", ptr=1 << 20):
    return ArrayInfo(tuple(shape), dtype, ("cuda", 0), ptr, None)


def _coeffs_infos(T, n, C, dt="bfloat16", grads=False):
    D, K = n * C, coeffs.columns(n)
    infos = {"x": _info((T, n, C), dt), "phi": _info((D, K)), "alpha": _info((3,)), "bias": _info((K,))}
    if grads:
        infos = {"grad_h_pre_raw": _info((T, n)), "grad_h_post_raw": _info((T, n)),
                 "grad_h_res_raw": _info((T, n, n)), **infos}
    return infos


def _names(plan, infos):
    """Kernel names ``plan`` launches for ``infos``, run as on a device with wgmma (sm_90a)."""
    with _jit.dry_run() as launches, _jit.assume_wgmma(True):
        ptrs = {k: (None if v is None else v.ptr) for k, v in infos.items()}
        plan.launch(ptrs, [1 << 20] * len(plan.outputs), [1 << 21] * len(plan.scratch), 0)
    return [expr.split("<")[0] for _, expr, *_ in launches]


def _launched(planner, infos, **params):
    """Kernel names of the plan made now (under the choice in force) for ``infos``."""
    return _names(planner(infos, **params), infos)


@pytest.mark.parametrize("wg_fwd", [None, True, False])
def test_wg_fwd_choice_picks_the_forward_gemm(wg_fwd):
    """bf16, n = 8 (K >= _WG_MIN_K): the wgmma forward GEMM unless wg_fwd=False (the mma.sync one);
    the layout made under the choice says so (no wgmma chunks)."""
    T, n, C = 300, 8, 64
    with kernel_choice(wg_fwd=wg_fwd):
        names = _launched(coeffs._plan_fwd, _coeffs_infos(T, n, C), eps=1e-5)
        layout = coeffs.mma_layout(T, n * C, coeffs.columns(n), "bfloat16")
    on = wg_fwd is not False
    assert ("mhc_coeffs_wg_fwd_kernel" in names) == on and ("mhc_coeffs_mma_fwd_kernel" in names) != on
    assert (layout.wg_kc > 0) == on


@pytest.mark.parametrize("wg_dx", [None, True, False])
@pytest.mark.parametrize("op", ["mhc_coeffs_bwd", "mhc_layer_pre_bwd"])
def test_wg_dx_choice_picks_the_dx(op, wg_dx):
    """bf16, n = 8, aligned: the wgmma dx (coefficient and layer backward) unless wg_dx=False (the
    mma.sync dx with phi resident); the forward GEMM is left as it was."""
    T, n, C = 300, 8, 72
    infos = _coeffs_infos(T, n, C, grads=op == "mhc_coeffs_bwd")
    if op == "mhc_coeffs_bwd":
        planner, params = coeffs._plan_bwd, {"eps": 1e-5}
    else:
        K = coeffs.columns(n)
        infos.update({"stats": _info((T, K + 1)), "H_pre": _info((T, n)), "H_res": _info((T, n, n)),
                      "grad_layer_in": _info((T, C), "bfloat16"), "grad_out": None, "grad_x": None,
                      "grad_H_post": _info((T, n)), "grad_H_res": _info((T, n, n))})
        planner, params = L._plan_pre_bwd, dict(num_iters=20, eps=1e-6, rms_eps=1e-5, grad_mode="unrolled",
                                                convention="paper", hc_eps=0.0, post_mult=2.0)
    with kernel_choice(wg_dx=wg_dx):
        names = _launched(planner, infos, **params)
    on = wg_dx is not False
    assert ("mhc_coeffs_wg_dx_kernel" in names) == on and ("mhc_coeffs_mma_dx_kernel" in names) != on
    assert ("mhc_coeffs_wg_fwd_kernel" in names) == (op == "mhc_coeffs_bwd")  # the bwd recomputes H~


# ------------------------------------------------------------------ plan caches
def test_plan_cache_keys_on_the_choice(monkeypatch):
    """_dispatch's plan cache serves a plan only to the choice it was built under."""
    monkeypatch.setattr(_dispatch, "_plans", {})
    infos, params = _coeffs_infos(300, 8, 64), {"eps": 1e-5}
    library = _dispatch._plan(coeffs._plan_fwd, infos, params)
    assert _dispatch._plan(coeffs._plan_fwd, infos, params) is library
    with kernel_choice(wg_fwd=False):
        mma = _dispatch._plan(coeffs._plan_fwd, infos, params)
        assert mma is not library and _dispatch._plan(coeffs._plan_fwd, infos, params) is mma
    with kernel_choice(wg_fwd=True):  # the library's kernels, but another choice: its own plan
        assert _dispatch._plan(coeffs._plan_fwd, infos, params) not in (library, mma)
    assert _dispatch._plan(coeffs._plan_fwd, infos, params) is library
    assert "mhc_coeffs_wg_fwd_kernel" in _names(library, infos) and "mhc_coeffs_mma_fwd_kernel" in _names(mma, infos)


def test_fast_path_entry_keys_on_the_choice(monkeypatch):
    """A fast-path entry (recorded launches) recorded under one choice is replayed under that choice
    only: under another the call plans (and records) afresh."""
    monkeypatch.setattr(_dispatch, "_fast", {})
    monkeypatch.setattr(_dispatch, "_fast_inputs", lambda arrays: (((3,), "float32", 0), [1 << 20], None, False))

    def planned(planner, arrays, key, params):  # what _run does on a GPU: plan, launch, record the entry
        _dispatch._fast[key] = "entry"
        return "planned"

    monkeypatch.setattr(_dispatch, "_run", planned)
    monkeypatch.setattr(_dispatch, "_run_fast", lambda entry, *a: "replayed")

    def call():
        return _dispatch.run(coeffs._plan_fwd, {"x": object()}, eps=1e-5)

    assert [call(), call()] == ["planned", "replayed"]
    with kernel_choice(wg_fwd=False):
        assert [call(), call()] == ["planned", "replayed"]
    with kernel_choice(wg_fwd=False, fused=False):
        assert call() == "planned"
    assert call() == "replayed" and len(_dispatch._fast) == 3


def test_jax_plans_key_on_the_choice_at_trace_time(monkeypatch):
    """The JAX adapter plans under the choice in force when it traces, keyed by it (a token-sharded
    host callback keeps it too)."""
    jax = pytest.importorskip("jax")
    import numpy as np

    from mhc_cupy import _jax_kernels as jk
    import mhc_cupy.jax as mj

    sig = (((300, 8, 64), "bfloat16"), ((512, 80), "float32"), ((3,), "float32"), ((80,), "float32"))
    params = (("eps", 1e-5),)
    library = jk._planned("mhc_coeffs_fwd", params, sig, KernelChoice())
    mma = jk._planned("mhc_coeffs_fwd", params, sig, KernelChoice(wg_fwd=False))
    infos = _coeffs_infos(300, 8, 64)
    assert "mhc_coeffs_wg_fwd_kernel" in _names(library[0], infos)
    assert "mhc_coeffs_mma_fwd_kernel" in _names(mma[0], infos)
    assert getattr(mma[1], "_mhc_token_sharded_host")[0][-1] == KernelChoice(wg_fwd=False)
    seen = []
    real = jk._planned

    def spy(name, params, signature, choice):
        seen.append(choice)
        return real(name, params, signature, choice)

    monkeypatch.setattr(jk, "_planned", spy)
    x = jax.numpy.zeros((1, 3, 11), "float32")  # a shape no other test traces (JAX caches traces)
    phi, alpha, bias = np.zeros((33, 15), np.float32), np.ones(3, np.float32), np.zeros(15, np.float32)
    with kernel_choice(wg_fwd=False):
        jax.jit(lambda x: mj.mhc_coeffs(x, phi, alpha, bias)).lower(x)  # traced, not run
    assert seen and set(seen) == {KernelChoice(wg_fwd=False)}


@pytest.mark.parametrize("op", ["mhc_coeffs", "stream_mix"])
def test_jax_ops_trace_anew_under_another_choice(monkeypatch, op):
    """An op of mhc_cupy.jax that ran at some shapes runs the plan of the choice in force at a later call of
    those shapes, eager and in a new jax.jit (its internal jit's traces key on the choice: before, the first
    trace served every later call, whatever the choice: break-it pass 18)."""
    jax = pytest.importorskip("jax")
    import numpy as np

    from mhc_cupy import _jax_kernels as jk
    import mhc_cupy.jax as mj

    seen = []
    real = jk._planned
    monkeypatch.setattr(jk, "_planned", lambda *a: (seen.append(a[-1]), real(*a))[1])
    x = jax.numpy.asarray(np.random.default_rng(0).standard_normal((3, 4, 8)), "float32")
    if op == "mhc_coeffs":
        phi, alpha, bias = np.full((32, 24), 0.01, np.float32), np.ones(3, np.float32), np.zeros(24, np.float32)
        f = lambda x: mj.mhc_coeffs(x, phi, alpha, bias)  # noqa: E731
    else:
        M = jax.numpy.full((3, 4, 4), 0.25, "float32")
        f = lambda x: mj.stream_mix(x, M)  # noqa: E731
    want, used = f(x), {KernelChoice()}
    for choice in (KernelChoice(small=True), KernelChoice(wg_fwd=False, tail=True), KernelChoice(),
                   KernelChoice(small=True)):
        for run in (f, jax.jit(f)):  # eager, then a new jit of the same shapes
            seen.clear()
            with kernel_choice(choice):
                got = run(x)
            assert all(c == choice for c in seen), (choice, seen)  # (a trace of this choice's own may serve it)
            if choice not in used:
                assert seen, f"{choice}: no plan made under it (another choice's trace served the call)"
                used.add(choice)
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)


# ------------------------------------------------------------------ MHC's fused
def test_mhc_reads_fused_when_built(monkeypatch):
    """MHC built under kernel_choice(fused=False) runs the separate ops wherever it is called; one
    built outside runs the fused pieces, also inside such a block (forward reads no context variable:
    torch.compile traces it)."""
    torch = pytest.importorskip("torch")
    from mhc_cupy.torch import MHC, layers

    calls = []
    for name in ("layer_pre", "mhc_pre_op"):
        def counted(*a, _f=getattr(layers, name), _name=name, **k):
            calls.append(_name)
            return _f(*a, **k)

        monkeypatch.setattr(layers, name, counted)
    x = torch.randn(2, 3, 8)
    with kernel_choice(fused=False):
        separate = MHC(8, 3)
    out = separate(x)  # outside the block: still the separate ops
    assert calls == ["mhc_pre_op"]
    calls.clear()
    library = MHC(8, 3)
    library.load_state_dict(separate.state_dict())
    with kernel_choice(fused=False):
        torch.testing.assert_close(library(x), out, rtol=1e-5, atol=1e-6)
    assert calls == ["layer_pre"]


def launched(op: str, tokens: int, n: int, C: int, with_grids: bool = False) -> list:
    """Kernel names that op's plan launches (a dry run on fake bf16 pointers) under the choice in force
    (``with_grids``: (name, grid) pairs)."""
    from mhc_cupy import _jit, _kernels
    from mhc_cupy.ops import SPECS

    k = SPECS[op]
    infos = _kernels._infos(k, (tokens,), {"n": n, "C": C, "K": n * n + 2 * n}, "bfloat16", "bfloat16",
                            _kernels._ALIGNED)
    with _jit.dry_run() as launches:
        plan = k.planner(infos, **k.params)
        plan.launch({a: v.ptr for a, v in infos.items()}, [_kernels._ALIGNED] * len(plan.outputs),
                    [_kernels._ALIGNED] * len(plan.scratch), 0)
    return [(expr.split("<")[0], tuple(grid)) if with_grids else expr.split("<")[0] for _, expr, grid, *_ in launches]


def test_the_boundary_kernel_runs_only_when_chosen():
    """mhc_boundary_fwd plans the fused kernel only under boundary=True (off by default until a GPU
    run has checked it); otherwise the post op's and the coefficient GEMM's kernels."""
    from mhc_cupy import _kernels

    names = functools.partial(launched, "mhc_boundary_fwd", 300, 4, 64)
    default = names()
    with kernel_choice(boundary=True):
        chosen = names()
    with kernel_choice(boundary=True, small=True):  # (300 tokens: not small)
        assert names() == chosen
    with kernel_choice(small=True):  # 64 tokens: the residual update inside the GEMV, then the tail: two launches
        assert launched("mhc_boundary_fwd", 64, 4, 64) == ["mhc_coeffs_gemv_fwd_kernel", "mhc_layer_pre_tail_kernel"]
    assert "mhc_boundary_fwd_kernel" in chosen and "mhc_stream_mix_distribute_fwd_kernel" not in chosen, chosen
    assert "mhc_boundary_fwd_kernel" not in default and "mhc_stream_mix_distribute_fwd_kernel" in default, default
    assert {e for _, e in _kernels.all_specialisations() if e.startswith("mhc_boundary")}, "CI compiles it"


@pytest.mark.parametrize("tokens,gemv", [(1, True), (64, True), (65, False)])
def test_the_small_token_forward_runs_only_when_chosen(tokens, gemv):
    """At most 64 tokens under small=True: the coefficient GEMM on CUDA cores (no planes pass) and the
    rest of the pre piece in one kernel; else, or by default, the tensor-core path."""
    names = functools.partial(launched, "mhc_layer_pre_fwd", tokens, 4, 72)
    default = names()
    with kernel_choice(small=True):
        chosen = names()
    assert "mhc_coeffs_gemv_fwd_kernel" not in default and "mhc_coeffs_split_phi_fwd_kernel" in default
    if gemv:  # the whole pre piece in two launches
        assert chosen == ["mhc_coeffs_gemv_fwd_kernel", "mhc_layer_pre_tail_kernel"], chosen
    else:
        assert chosen == default


@pytest.mark.parametrize("op", ["mhc_layer_pre_fwd", "mhc_boundary_fwd", "mhc_layer_pre_norm_fwd"])
@pytest.mark.parametrize("tokens", [1, 64, 65])
@pytest.mark.parametrize("n,wgmma", [(4, False), (8, True)])
def test_the_one_launch_tail_runs_only_when_chosen(op, tokens, n, wgmma):
    """At most 64 tokens under tail=True: the tensor-core GEMM as by default (planes, then mma.sync or, bf16
    n >= 7 on sm_90, wgmma), then the rest of the pre piece in mhc_layer_pre_tail_kernel: finish, Sinkhorn
    and aggregate become one launch (the aggregate's stand-in, the layer_in kernel, still runs after it);
    from 65 tokens, and by default, the separate kernels."""
    from mhc_cupy import _jit

    names = functools.partial(launched, op, tokens, n, 72)
    with _jit.assume_wgmma(wgmma), kernel_choice(layer_in=True):
        default = names()
        with kernel_choice(tail=True):
            chosen = names()
    assert "mhc_layer_pre_tail_kernel" not in default
    if tokens > 64:
        assert chosen == default
        return
    separate = ["mhc_coeffs_fwd_finish_kernel", "mhc_sinkhorn_knopp_fwd_kernel", "mhc_stream_aggregate_fwd_kernel"]
    gemm = [k for k in default if k not in separate]
    assert len(gemm) == len(default) - (2 if op == "mhc_layer_pre_norm_fwd" else 3), default
    assert ("mhc_coeffs_wg_fwd_kernel" in gemm) == wgmma and "mhc_coeffs_gemv_fwd_kernel" not in gemm
    if op == "mhc_layer_pre_norm_fwd":  # the layer_in kernel (in place of the aggregate) after the tail
        assert chosen == gemm[:-1] + ["mhc_layer_pre_tail_kernel", gemm[-1]], chosen
    else:
        assert chosen == gemm + ["mhc_layer_pre_tail_kernel"], chosen


def test_torch_backward_plans_under_the_choice_of_its_forward(monkeypatch):
    """A torch backward may run where the forward's kernel_choice block is not: after it, or (CUDA
    tensors) in autograd's device thread, which does not see the caller's context variables.  The eager
    ops' backward (an op's, the fused layer pieces') plans under the choice their forward ran under."""
    import threading

    torch = pytest.importorskip("torch")
    import mhc_cupy.torch as mt
    from mhc_cupy import _dispatch
    from mhc_cupy._kernel_choice import current

    seen = []
    plan = _dispatch._plan
    monkeypatch.setattr(_dispatch, "_plan", lambda *a: seen.append(current()) or plan(*a))
    x = torch.randn(3, 4, 8, requires_grad=True)
    layer = mt.MHC(8, 4)
    for f in (lambda: mt.mhc_coeffs(x, layer.phi, layer.alpha, layer.bias)[2], lambda: layer(x)):
        for where in ("thread", "after"):
            with kernel_choice(wg_dx=False):
                out = f()
            seen.clear()
            if where == "thread":
                thread = threading.Thread(target=out.sum().backward)
                thread.start()
                thread.join()
            else:
                out.sum().backward()
            assert seen and all(c.wg_dx is False for c in seen), (where, seen)


def _planned_launches(op: str, tokens: int, n: int, C: int, dt: str, misalign: bool) -> tuple:
    """(launches by kernel name -> [args by name], scratch names by pointer, outputs' pointers) of op's plan
    in a dry run on distinct fake pointers (the activations 2 bytes off 16 with ``misalign``)."""
    from mhc_cupy import _jit, _kernels
    from mhc_cupy.ops import SPECS
    from mhc_cupy.ops.spec import shape_of

    k = SPECS[op]
    ptr = iter(range(1 << 32, 1 << 50, 1 << 28))
    sizes = {"n": n, "C": C, "K": n * n + 2 * n}
    infos = {a.name: _kernels._info(shape_of(a, (tokens,), sizes), dt if a.kind == "activation" else "float32",
                                    next(ptr) + (2 if misalign and a.kind == "activation" else 0)) for a in k.args}
    with _jit.dry_run() as launches:
        plan = k.planner(infos, **k.params)
        outs = [next(ptr) for _ in plan.outputs]
        base = next(ptr)
        scratch = [base + o for o in plan.scratch_layout[1]]
        plan.launch({a: v.ptr for a, v in infos.items()}, outs, scratch, 0)
    by_name = {}
    for _, expr, grid, block, args, _ in launches:
        by_name.setdefault(expr.split("<")[0], []).append((expr, args))
    return by_name, dict(zip(scratch, plan.scratch)), outs


@pytest.mark.parametrize("boundary", [False, True])
@pytest.mark.parametrize("op", ["mhc_layer_pre_fwd", "mhc_boundary_fwd", "mhc_layer_pre_fp8_fwd"])
@pytest.mark.parametrize("tokens,n,C,dt,misalign", [(1, 1, 8, "float32", False), (7, 3, 13, "float16", True),
                                                    (64, 4, 64, "bfloat16", False), (5, 8, 24, "bfloat16", True),
                                                    (3, 16, 72, "float16", False), (2, 32, 8, "bfloat16", False),
                                                    (5, 2, 200, "float16", False)])  # fused boundary: 4 splits, GEMM 1
def test_the_tail_reads_what_the_default_path_reads(op, tokens, n, C, dt, misalign, boundary):
    """Under tail=True the tail kernel takes the GEMM's part with the splits the default path's finish kernel
    sums (the fused boundary kernel's own splits under boundary=True), the aggregate's x, layer_in where the
    op's (or, for the layer_in ops, their scratch) goes, and the aggregate's vector width E; the GEMM
    launches are the default's.  (Dry runs, mma.sync and wgmma.)"""
    from mhc_cupy import _jit
    from mhc_cupy.ops._launch import vec_width
    from mhc_cupy.ops.coeffs.fwd import FINISH
    from mhc_cupy.ops.layer import PRE_TAIL

    if boundary and op != "mhc_boundary_fwd":
        pytest.skip("the boundary choice is the boundary op's")
    tail_only = {"mhc_layer_pre_tail_kernel", "mhc_coeffs_fwd_finish_kernel", "mhc_sinkhorn_knopp_fwd_kernel",
                 "mhc_stream_aggregate_fwd_kernel", "mhc_stream_aggregate_out_kernel"}
    for wg in (False, True):
        with _jit.assume_wgmma(wg), kernel_choice(layer_in=True, boundary=boundary):
            default, sc0, _ = _planned_launches(op, tokens, n, C, dt, misalign)
            with kernel_choice(tail=True):
                chosen, sc1, outs = _planned_launches(op, tokens, n, C, dt, misalign)
        assert {k: [e for e, _ in v] for k, v in default.items() if k not in tail_only} == \
            {k: [e for e, _ in v] for k, v in chosen.items() if k not in tail_only}
        (expr, args), = chosen["mhc_layer_pre_tail_kernel"]
        t = dict(zip([p for _, p in PRE_TAIL.params], args))
        f = dict(zip([p for _, p in FINISH.params], default["mhc_coeffs_fwd_finish_kernel"][0][1]))
        assert int(t["splits"]) == int(f["splits"]) and sc1[t["part"]] == sc0[f["part"]] == "part"
        agg = (default.get("mhc_stream_aggregate_fwd_kernel") or default["mhc_stream_aggregate_out_kernel"])[0][1]
        assert t["x"] == agg[0]
        if op == "mhc_layer_pre_fp8_fwd":
            assert sc1[t["layer_in"]] == "layer_in"
            (_, out_args), = chosen["mhc_stream_aggregate_out_kernel"]
            assert out_args[1] == t["H_pre"]
        else:
            assert t["layer_in"] == outs[1 if op == "mhc_boundary_fwd" else 0]
        assert int(expr.rstrip(">").split(",")[-1]) == vec_width(n, C, [(t["x"], dt), (t["layer_in"], dt)])
