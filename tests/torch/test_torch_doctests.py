"""The examples in the PyTorch adapter's docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytest.importorskip("torch")

MODULES = [
    "gradient_accumulator.torch",
    "gradient_accumulator.torch.optimizer",
    "gradient_accumulator.torch.batchnorm",
    "gradient_accumulator.torch.agc",
    "gradient_accumulator.torch.context",
    "gradient_accumulator.torch.distributed",
    "gradient_accumulator.torch.fused",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest lines failed"
    if name != "gradient_accumulator.torch.distributed":
        assert result.attempted > 0
