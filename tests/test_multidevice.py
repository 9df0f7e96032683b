"""Multi-device support on the CPU (CI): JAX token sharding over 2 host devices.

Each check runs in its own process (``tests/multidevice``): JAX takes its
device count from ``XLA_FLAGS`` once, when it initialises.  See
``tests/multidevice/jax_sharding_cases.py`` for what is checked.
"""

from __future__ import annotations

import pytest

from multidevice import pytest_cases


@pytest.mark.slow
def test_jax_token_sharding_two_host_devices():
    pytest.importorskip("jax")
    pytest_cases("jax_sharding_cases.py", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                           "JAX_PLATFORMS": "cpu"})
