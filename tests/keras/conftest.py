"""Keras adapter tests: one backend per pytest process, chosen by KERAS_BACKEND.

The backend is fixed before Keras is imported. The TensorFlow process gets two logical CPU
devices and the JAX process two host devices, so the distributed tests run on real replicas.
"""

from __future__ import annotations

import os

import pytest

BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if BACKEND == "jax":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()

pytest.importorskip(BACKEND if BACKEND != "tensorflow" else "tensorflow")
if BACKEND == "tensorflow":
    import tensorflow as tf

    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )

keras = pytest.importorskip("keras")
if keras.backend.backend() != BACKEND:  # pragma: no cover - Keras was imported earlier
    raise RuntimeError(
        f"Keras was imported with backend {keras.backend.backend()!r} before KERAS_BACKEND="
        f"{BACKEND!r} took effect: run one pytest process per backend"
    )


# fp32 matrix products in full fp32 on GPUs, so that fp32 training can be compared with an fp64
# reference at 1e-5 (tests/cuda does the same for torch): JAX's default precision on Ampere and
# later GPUs is TF32 (27 equivalence tests 2e-5…1.2e-3 off on an H200), TensorFlow's too, and
# cuDNN's convolutions under torch. On CPUs these settings change nothing.
if BACKEND == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
elif BACKEND == "tensorflow":
    tf.config.experimental.enable_tensor_float_32_execution(False)
elif BACKEND == "torch":
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    # Third-party notices that are not about this package (pyproject turns warnings into errors).
    for line in (
        "ignore:.*does not implement the AsGraphDefInternal.*",
        "ignore::UserWarning:keras.*",
        "ignore::FutureWarning",
    ):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Each test starts from the default dtype policy, no distribution and a cleared session."""
    keras.backend.clear_session()
    keras.config.set_dtype_policy("float32")
    if BACKEND == "jax":
        keras.distribution.set_distribution(None)
    yield
    keras.config.set_dtype_policy("float32")
    if BACKEND == "jax":
        keras.distribution.set_distribution(None)


@pytest.fixture
def backend() -> str:
    """The Keras backend of this process."""
    return BACKEND
