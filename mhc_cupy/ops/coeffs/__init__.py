"""The mHC coefficient path: raw coefficients from the residual stream (OPS.md section 8,
paper Eqs. 14-18).

Per token: H~ = vec(x) @ phi, r = sqrt(mean(vec(x)^2) + eps), h = alpha_grp H~ / r + bias,
split into h_pre_raw [n], h_post_raw [n], h_res_raw [n, n].  The launch layout
(column chunks, D ranges, token splits) depends only on shapes and dtypes and is the same
on every device, so results are bitwise reproducible for given shapes.

One module per kernel family, each with its kernels' typed launch descriptions
(:class:`mhc_cupy.ops._launch.KernelSpec`), its layout choice and launches: ``fwd`` (the forward
GEMM and finish, ``kernels_cu/coeffs_fwd.cu``), ``bwd`` (the backward's prep and bf16 planes, and
dx and dphi in one kernel for n <= 4, ``coeffs_bwd.cu``), ``split_bwd`` (dphi and dx as two kernels
for n > 4, ``coeffs_dphi.cu``, ``coeffs_dx.cu``); ``common`` (checks, limits) and ``plans`` (the
plans, the public functions and the op specs).  The head (``ops/head.py``) reuses the forward GEMM.
"""

from .bwd import MmaBwd, launch_mma_bwd, launch_prep, mma_bwd
from .common import check, check_vec_x, columns, padded_row
from .fwd import MmaLayout, launch_finish, launch_mma_gemm, mma_fwd_smem, mma_layout, mma_sub
from .plans import (KERNELS, _plan_bwd, _plan_fwd, backward_layout, launch_param_bwd, mhc_coeffs_bwd, mhc_coeffs_fwd,
                    param_grad_plan)
from .split_bwd import SplitBwd, dx_tile_layout, launch_split_bwd, wg_dx_layout
