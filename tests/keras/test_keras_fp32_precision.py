"""The Keras tests run fp32 matrix products in full fp32 on every backend (conftest.py): with
TF32, JAX's default on Ampere and later GPUs, 27 equivalence tests missed their 1e-5 bound
against the fp64 reference on an H200."""

from __future__ import annotations


def test_fp32_matmuls_are_not_tf32(backend):
    if backend == "jax":
        import jax

        assert jax.config.jax_default_matmul_precision == "highest"
    elif backend == "tensorflow":
        import tensorflow as tf

        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    else:
        import torch

        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
