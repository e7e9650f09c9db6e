"""The examples in the Keras adapter's docstrings run and print what they claim, per backend."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "gradient_accumulator.keras",
    "gradient_accumulator.keras.optimizer",
    "gradient_accumulator.keras.model",
    "gradient_accumulator.keras.layers",
    "gradient_accumulator.keras.agc",
    "gradient_accumulator.keras.utils",
    "gradient_accumulator.keras.callbacks",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest lines failed"
    assert result.attempted > 0
