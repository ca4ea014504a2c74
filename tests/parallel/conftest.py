"""The distributed tests need several devices: on JAX's CPU platform,
``KERAS_LONGATTN_HOST_DEVICES=8`` (read by the project's conftest.py before
JAX starts; ``scripts/test.sh`` runs this folder that way). With fewer
devices the tests that need them are skipped, unless
``KERAS_LONGATTN_HOST_DEVICES`` is set, which makes a shortfall an error.
"""

import os

import keras
import pytest

DEVICES = 8


def device_count():
    if keras.backend.backend() != "jax":
        return 0
    import jax

    return jax.device_count()


@pytest.fixture
def devices():
    """The number of devices, at least ``DEVICES`` (else skip or fail)."""
    count = device_count()
    if count >= DEVICES:
        return count
    wanted = os.environ.get("KERAS_LONGATTN_HOST_DEVICES")
    if keras.backend.backend() == "jax" and wanted:
        pytest.fail(f"KERAS_LONGATTN_HOST_DEVICES={wanted} but JAX has {count} device(s): "
                    "JAX started before the flag was set")
    pytest.skip(f"needs {DEVICES} JAX devices (KERAS_LONGATTN_HOST_DEVICES={DEVICES}); "
                f"backend {keras.backend.backend()!r} has {count}")
