"""MHC.forward without autograd on a repeated call (``mhc_cupy.torch._no_grad``), without a GPU: CPU tensors
pose as CUDA ones (``scripts/host_overhead_cpu.py``'s ``pose_as_gpu``), every launch is recorded (a dry run),
and the lane must queue the general route's launches: the same kernels, grids, scalars and, up to a renaming
of the buffers the caller never sees, the same pointers, with three allocations instead of seven."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import mhc_cupy.torch as mt
from mhc_cupy import _dispatch, _jit
from mhc_cupy._kernel_choice import kernel_choice
from mhc_cupy.torch import _no_grad, layers

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "host_overhead_cpu.py"


@pytest.fixture
def posed(monkeypatch):
    """CPU tensors take the GPU route (planned dry, launches recorded by dry runs); an empty fast-path cache,
    restored after (its entries hold a front end of this pose); the kernel choice lane in force."""
    spec = importlib.util.spec_from_file_location("host_overhead_cpu", _PATH)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(_dispatch, "_fast", {})
    script.pose_as_gpu(monkeypatch.setattr, record=True)
    made = []  # every allocation, kept: no address is reused, so a pointer names one buffer

    def empty(self, *a):
        made.append(real(self, *a))
        return made[-1]

    real = script._FrontEnd.empty
    monkeypatch.setattr(script._FrontEnd, "empty", empty)
    with kernel_choice(lane=True):  # (off by default until a GPU run has checked it)
        yield made


class Sublayer(torch.nn.Module):
    """A new tensor from layer_in, optionally a strided one; layer_in's and the output's pointers noted, the
    output kept in ``made``."""

    def __init__(self, made: list, strided=False):
        super().__init__()
        self.made, self.strided, self.seen = made, strided, []

    def forward(self, li):
        y = li * 2 + 1
        if self.strided and y.dim() >= 2 and y.shape[-2] > 1:
            y = y.mT.contiguous().mT
        self.made.append(y)
        self.seen.append((li.data_ptr(), y.data_ptr()))
        return y


def _call(layer, x, lane: bool):
    """(launches, {pointer: role} of layer_in, the sublayer's output and the layer's, the output) of one
    no-grad call through the lane or the general route."""
    with torch.no_grad(), _jit.dry_run() as launches:
        if lane:
            out = layer(x)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(layers, "_no_grad_forward", lambda *a: None)
                out = layer(x)
    (li, y), o = layer.sublayer.seen[-1], out.data_ptr()
    return list(launches), {li: "layer_in", y: "y", o: "out"}, out


def _same_launches(general, lane, fixed: dict, made_general: list, made_lane: list) -> None:
    """The launches equal but for pointers, which correspond one to one (``fixed``: pointers of the general
    call -> the lane's, known in advance: the inputs, layer_in, the output), and the lane's buffers as large
    as the general route's and apart (each general buffer reaches to the next pointer in its allocation or
    that allocation's end; ``made_*``: each call's allocations, none freed)."""
    assert len(general) == len(lane) > 0
    ptr_map, seen = dict(fixed), {}
    for g, f in zip(general, lane):
        assert g[:4] == f[:4] and g[5] == f[5]  # file, name, grid, block, shared memory
        assert len(g[4]) == len(f[4])
        for a, b in zip(g[4], f[4]):
            if type(a) is int and a:
                assert ptr_map.setdefault(a, b) == b, "a buffer read / written in another place"
                assert seen.setdefault(b, a) == a, "two buffers of the general route in one place of the lane"
            else:
                assert type(a) is type(b) and (a == b or a is b is None)
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in made_general]
    starts = sorted(ptr_map)
    regions = []
    for a, b in ptr_map.items():
        if a in fixed and fixed[a] == a:  # an input: the same tensor
            continue
        hi = next((hi for lo, hi in spans if lo <= a < hi), None)
        if hi is not None:  # (else a copy the route made itself: not the lane's placing)
            regions.append((b, b + min([p for p in starts if a < p < hi] + [hi]) - a))
    regions.sort()
    assert all(e <= s for (_, e), (s, _) in zip(regions, regions[1:])), "lane buffers overlap"
    lane_spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in made_lane]
    assert all(any(lo <= s and e <= hi for lo, hi in lane_spans) for s, e in regions), "a buffer beyond its allocation"


def _lane_matches_general(layer, x, made) -> None:
    """A general call, then one through the lane: the same launches (``_same_launches``)."""
    start = len(made)
    general, roles_g, out_g = _call(layer, x, lane=False)
    allocs = len(made)
    lane, roles_f, out_f = _call(layer, x, lane=True)
    assert _no_grad._LANES[layer].parts[0][0] == x.shape
    assert out_f.shape == x.shape and out_f.dtype == x.dtype
    fixed = {p.data_ptr(): p.data_ptr() for p in (x, layer.phi, layer.alpha, layer.bias)}
    by_role = {role: p for p, role in roles_f.items()}
    fixed |= {p: by_role[role] for p, role in roles_g.items()}
    _same_launches(general, lane, fixed, made[start:allocs], made[allocs:])
    return len(made) - allocs - 1  # the allocations of the lane's call (the sublayer's output not counted)


@pytest.mark.parametrize("T,n,C,dtype,convention", [
    (1, 4, 64, torch.bfloat16, "paper"), (3, 1, 7, torch.float32, "deepseek"), (127, 2, 40, torch.float16, "paper"),
    ((2, 3), 8, 24, torch.bfloat16, "deepseek"), (5, 32, 8, torch.float32, "paper")])
def test_lane_queues_the_general_routes_launches(posed, T, n, C, dtype, convention):
    torch.manual_seed(0)
    layer = mt.MHC(C, n, Sublayer(posed), convention=convention)
    x = torch.randn(*(T if isinstance(T, tuple) else (T,)), n, C).to(dtype)
    assert _lane_matches_general(layer, x, posed) == 3  # layer_in, one buffer, the output (the general route: 7)
    assert _lane_matches_general(layer, x, posed) == 3  # (the lane built by the first call, used again)


def test_lane_follows_shapes_choices_and_falls_back(posed):
    torch.manual_seed(1)
    layer = mt.MHC(16, 4, Sublayer(posed))
    x1, x3 = torch.randn(1, 4, 16), torch.randn(3, 4, 16)
    for x in (x1, x3, x1):  # a new shape: a new lane, built once a general call left its entries
        _lane_matches_general(layer, x, posed)
    with kernel_choice(tail=True):  # another kernel choice: the general route, then a lane of its own
        _call(layer, x3, lane=True)  # (no entries of this choice yet: the general route, which leaves them)
        assert _no_grad._LANES[layer].choice is not _no_grad._kernel_choice()
        _lane_matches_general(layer, x3, posed)
        assert _no_grad._LANES[layer].choice is _no_grad._kernel_choice()
    layer.sublayer.strided = True  # a strided sublayer output: the general post op, on views of the lane's buffer
    assert _lane_matches_general(layer, x3, posed) == 3


def test_lane_is_not_taken_with_grad_or_in_a_fused_stack(posed, monkeypatch):
    taken = []
    monkeypatch.setattr(layers, "_no_grad_forward", lambda *a: taken.append(1) or _no_grad.forward(*a))
    layer = mt.MHC(16, 4, Sublayer(posed))
    x = torch.randn(2, 4, 16)
    with _jit.dry_run():
        with torch.no_grad():
            layer(x)
        assert taken == [1]
        layer(x.requires_grad_())  # grad mode on: autograd records, no lane
        stack = mt.MHCStack([mt.MHC(16, 4, Sublayer(posed)) for _ in range(3)], fuse_boundaries=True)
        with torch.no_grad():
            stack(x)
            stack(x)
    assert taken == [1]  # the stack's layers get the fused boundaries, not the lane


def test_a_layer_that_took_the_lane_copies_and_pickles(posed):
    import copy
    import pickle

    layer = mt.MHC(16, 4, torch.nn.Identity())
    x = torch.randn(2, 4, 16)
    with _jit.dry_run(), torch.no_grad():
        layer(x)
        layer(x)
    assert layer in _no_grad._LANES
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert twin not in _no_grad._LANES and torch.equal(twin.phi, layer.phi)


def test_lane_is_off_by_default(posed):
    layer = mt.MHC(16, 4, torch.nn.Identity())
    x = torch.randn(2, 4, 16)
    with _jit.dry_run(), torch.no_grad(), kernel_choice(lane=None):
        layer(x)
        layer(x)
    assert layer not in _no_grad._LANES


# ---------------------------------------------------------------- break-it pass 17: each failed before its fix
def _launches(layer, x, lane: bool):
    """(launches, output) of one no-grad call through the lane or the general route."""
    with torch.no_grad(), _jit.dry_run() as launches, pytest.MonkeyPatch.context() as mp:
        if not lane:
            mp.setattr(layers, "_no_grad_forward", lambda *a: None)
        out = layer(x)
    return list(launches), out


@pytest.mark.parametrize("lane", [False, True])
def test_a_parametrized_phi_is_computed_once_a_call(lane):
    """spectral_norm on phi (training mode: a power iteration at each read), plain CPU tensors: the lane
    declines (CPU), and the general route uses the phi it read, so results do not depend on the lane."""
    from torch.nn.utils.parametrizations import spectral_norm

    def run(lane):
        torch.manual_seed(0)
        layer = spectral_norm(mt.MHC(16, 4), "phi")
        x = torch.randn(2, 4, 16)
        with torch.no_grad(), kernel_choice(lane=lane):
            return [layer(x) for _ in range(3)][-1]

    assert torch.equal(run(False), run(lane))


def test_a_parametrized_phi_is_read_once_where_the_lane_declines(posed):
    from torch.nn.utils import parametrize

    reads = []

    class Count(torch.nn.Module):
        def forward(self, w):
            reads.append(1)
            return w

    layer = mt.MHC(16, 4, torch.nn.Identity())
    parametrize.register_parametrization(layer, "phi", Count())
    x = torch.randn(4, 2, 16).transpose(0, 1)  # not contiguous: the lane declines after reading phi
    for lane in (False, True):
        reads.clear()
        _launches(layer, x, lane)
        assert len(reads) == 1, (lane, len(reads))


def test_the_lane_checks_x_as_the_general_route(posed):
    """MHC(16, 4) given an MHC(32, 4)'s phi: both routes raise the shape error (the lane could have been built
    from the other layer's fast-path entries of the same settings)."""
    a, b = mt.MHC(16, 4, torch.nn.Identity()), mt.MHC(32, 4, torch.nn.Identity())
    x = torch.randn(2, 4, 32)
    _launches(b, x, True)
    _launches(b, x, True)
    a.phi = torch.nn.Parameter(b.phi.detach().clone())
    for lane in (False, True):
        with pytest.raises(ValueError, match="dim=16"):
            _launches(a, x, lane)


def test_the_shape_error_comes_first_under_vmap():
    layer = mt.MHC(16, 4)
    for lane in (False, True):
        with torch.no_grad(), kernel_choice(lane=lane), pytest.raises(ValueError, match="dim=16"):
            torch.func.vmap(layer)(torch.randn(3, 2, 4, 15))


def test_the_post_op_reads_x_where_it_is_after_the_sublayer(posed):
    """A sublayer that gives x new storage (x.set_): the post op reads the new storage, as the general route's."""
    box = {}

    class SetX(torch.nn.Module):
        def forward(self, li):
            box["x"].set_(torch.randn(box["x"].shape))
            return li * 2

    layer = mt.MHC(16, 4, SetX())
    for lane in (False, True, True):
        x = box["x"] = torch.randn(2, 4, 16)
        launches, _ = _launches(layer, x, lane)
        assert x.data_ptr() in launches[-1][4], lane


def test_a_kernel_choice_the_sublayer_leaves_holds_for_the_post_op(posed):
    """The general route plans the post op under the choice in force after the sublayer (small: a token's
    columns over 2 blocks); so does the lane (it takes the general post op then)."""
    import dataclasses

    from mhc_cupy import _kernel_choice

    x = torch.randn(1, 4, 4096, dtype=torch.bfloat16)
    _launches(mt.MHC(4096, 4, torch.nn.Identity()), x, True)  # another layer leaves the entries of these shapes

    class Small(torch.nn.Module):
        def forward(self, li):
            _kernel_choice._CURRENT.set(dataclasses.replace(_kernel_choice.current(), small=True))
            return li * 2

    layer, grids = mt.MHC(4096, 4, Small()), []
    for lane in (False, True, True):
        token = _kernel_choice._CURRENT.set(_kernel_choice.current())
        launches, _ = _launches(layer, x, lane)
        _kernel_choice._CURRENT.reset(token)
        grids.append(launches[-1][2])
    assert grids[0] == grids[1] == grids[2], grids


def test_an_unhashable_layer_takes_the_general_route(posed):
    class Eq(mt.MHC):
        def __eq__(self, other):
            return self is other

    layer, x = Eq(8, 2, torch.nn.Identity()), torch.randn(1, 2, 8)
    general = [launch[:4] for launch in _launches(layer, x, False)[0]]  # (kernels and grids: pointers are new)
    for _ in range(2):
        assert [launch[:4] for launch in _launches(layer, x, True)[0]] == general and general


def test_an_equal_kernel_choice_keeps_the_lane(posed):
    """A new kernel_choice block each step (a new, equal KernelChoice): the lane is not rebuilt."""
    layer, x = mt.MHC(16, 4, Sublayer(posed)), torch.randn(2, 4, 16)
    _launches(layer, x, True)
    with kernel_choice(lane=True):
        _launches(layer, x, True)
    lane = _no_grad._LANES[layer]
    with kernel_choice(lane=True):
        _launches(layer, x, True)
    assert _no_grad._LANES[layer] is lane
