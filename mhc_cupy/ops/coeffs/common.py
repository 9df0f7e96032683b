"""What the coefficient path's kernel families share: the column count, argument checks, the
limits every launch layout keeps, the pipeline-depth rule and the token splits of the tensor-core
backward (``kernels_cu/coeffs.cuh``, ``mma.cuh``)."""

from __future__ import annotations

from ... import _checks
from .._launch import ITEMSIZE, tokens_of
from ..stream import check_x

_NT = 256  # threads per block of the per-token kernels (and of mhc_coeffs_bwd_dphi_kernel, NT)
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
_MAX_PARTIAL_FLOATS = 16 * 2**20  # dphi partials of the backward: at most 64 MiB
#: Longest vec(x) (D = n * C): the kernels index positions of D in 32 bits,
#: with overshoots of up to a D range past D (phi is D x (n^2 + 2n) floats: 12 GiB at n = 1).
_MAX_D = 2**30
_MMA_TARGET_BLOCKS = 1024  # 128-thread blocks; a constant (not the SM count): same bits on every GPU
_MMA_BWD_STAGES = 3  # cp.async pipeline depth of the tensor-core backward kernels (at most)
#: Dynamic shared memory a block may use on every supported GPU: the opt-in limit of
#: sm_86 / sm_89 / sm_120 (99 KiB; sm_80 has 163 KiB, sm_90 227 KiB).  The pipelines
#: use fewer stages when the deepest one would need more (float32 x), and the n = 4 backward of
#: 16-bit x with the layer's g staged 2 for occupancy (MmaBwd.pipeline); the depth does not
#: change the order of any sum.
_SMEM_PORTABLE = 101376


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def columns(n: int) -> int:
    """K = n*n + 2n columns of phi (pre | post | res)."""
    return n * n + 2 * n


def padded_row(K: int) -> int:
    """Row stride of dH [T, K+1] (column K holds c), rounded up to a multiple of 4."""
    return _cdiv(K + 1, 4) * 4


# ------------------------------------------------------------------ checks
def check_vec_x(info, op: str):
    """(dtype, lead dims, n, C, D = n*C) of an x whose vec(x) feeds the coefficient GEMM."""
    dt, lead, n, C = check_x("x", info)
    if C == 0:
        raise ValueError(f"x has shape {tuple(info.shape)}; {op} needs C >= 1 "
                         "(the RMS of an empty vector is undefined)")
    D = n * C
    if D > _MAX_D:
        raise ValueError(f"x has shape {tuple(info.shape)}: n * C = {D} exceeds the supported maximum "
                         f"2^30 = {_MAX_D} of the coefficient path")
    return dt, lead, n, C, D


def check(infos, eps, with_grads: bool, eps_name: str = "eps"):
    """(dtype, lead dims, n, C, D, K, tokens, eps) of the coefficient path's inputs (x, phi, alpha,
    bias and, ``with_grads``, the raw coefficients' gradients, each None or float32 of the forward
    output's shape).

    Raises:
        TypeError / ValueError: an input of the wrong dtype or shape, or a bad eps (named ``eps_name``).
    """
    dt, lead, n, C, D = check_vec_x(infos["x"], "mhc_coeffs")
    K = columns(n)
    for name, shape, why in (("phi", (D, K), "[n*C, n*n + 2n] with n, C of x; columns pre | post | res"),
                             ("alpha", (3,), "(alpha_pre, alpha_post, alpha_res)"),
                             ("bias", (K,), "[n*n + 2n], the column order of phi")):
        _checks.coefficient(name, infos[name])
        _checks.expect_shape(name, infos[name].shape, shape, why)
    if with_grads:
        for name, shape in (("grad_h_pre_raw", lead + (n,)), ("grad_h_post_raw", lead + (n,)),
                            ("grad_h_res_raw", lead + (n, n))):
            if infos[name] is not None:
                _checks.coefficient(name, infos[name])
                _checks.expect_shape(name, infos[name].shape, shape, "the shape of the forward output")
    return dt, lead, n, C, D, K, tokens_of(lead), _checks.eps(eps_name, eps)


# ------------------------------------------------------------------ layout rules
def pipeline_stages(size, most: int) -> int:
    """The deepest pipeline (<= most, >= 2 stages) whose shared memory ``size(stages)`` fits _SMEM_PORTABLE."""
    for stages in range(most, 2, -1):
        if size(stages) <= _SMEM_PORTABLE:
            return stages
    return 2


def mma_token_splits(tokens: int, blocks: int, most: int) -> tuple[int, int]:
    """(splits, tokens per split, a multiple of 16) of a tensor-core backward kernel's token
    ranges: enough for _MMA_TARGET_BLOCKS blocks with ``blocks`` per range, at most ``most``."""
    splits = min(_cdiv(_MMA_TARGET_BLOCKS, blocks), _cdiv(tokens, _MIN_TOKENS_PER_SPLIT), most)
    per = _cdiv(_cdiv(max(tokens, 1), max(1, splits)), 16) * 16
    return _cdiv(max(tokens, 1), per), per


def planes(dt: str) -> int:
    """bf16 planes of phi and dH that the tensor-core dx (mhc_coeffs_mma_dx_kernel, the dx part of
    mhc_coeffs_mma_bwd_kernel) multiplies for activations of dtype dt (PO in kernels_cu/coeffs_bwd.cu,
    coeffs_dx.cu)."""
    return 3 if ITEMSIZE[dt] == 4 else 2
