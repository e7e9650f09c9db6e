"""The original package's module path of adaptive gradient clipping (gradient-accumulator 0.5).

``compute_norm``, ``unitwise_norm`` and ``adaptive_clip_grad`` are the Keras 3 backend-op
versions of :mod:`gradient_accumulator.keras`, with 0.5's signatures and defaults
(``clip_factor=0.01, eps=1e-3``). Importing this module imports Keras.
"""

from gradient_accumulator.keras.agc import adaptive_clip_grad, compute_norm, unitwise_norm

__all__ = ["adaptive_clip_grad", "compute_norm", "unitwise_norm"]
