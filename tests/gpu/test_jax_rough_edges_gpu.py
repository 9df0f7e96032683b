"""Issue 41 item 6 on a GPU: ``jax.grad`` inside ``jax.shard_map`` (check_vma on, the default) for
every op and ``mhc_layer``, on a one-GPU mesh: the kernels' results and gradients carry the types
that shard_map checks, and the gradients equal those of the same program without shard_map (the
cases and the check of tests/test_jax_rough_edges.py; two GPUs: tests/gpu/test_multidevice_gpu.py
runs tests/multidevice/jax_sharding_cases.py, these cases included)."""

from __future__ import annotations

import pytest

from .helpers import JAX_GPU, jax_gpu_ok


pytestmark = JAX_GPU

if jax_gpu_ok():
    import jax

    import test_jax_rough_edges as rough  # tests/ is on sys.path (tests/conftest.py)

    CASES = rough.SHARD_CASES
else:  # collected but skipped
    CASES = ["skipped"]


@pytest.mark.parametrize("name", CASES)
def test_grad_inside_shard_map_gpu(name, rng):
    with jax.default_device(jax.devices("gpu")[0]):
        rough.check_grad_inside_shard_map(name, rng, jax.devices("gpu")[:1])
