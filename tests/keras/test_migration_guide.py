"""docs/migration.md: its Keras 3 code runs as written on every backend (blocks marked
``<!-- not run`` are the 0.5 code it replaces), and the Keras 3 changes it lists hold."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

keras = pytest.importorskip("keras")

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def _blocks() -> list[tuple[int, str, bool]]:
    """(line, code, runs) for every ```python block of the guide."""
    text = GUIDE.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", text, flags=re.S):
        out.append((text[: m.start(2)].count("\n") + 1, m.group(2), m.group(1) is None))
    return out


def test_the_guide_has_code_that_runs_and_code_that_is_marked():
    blocks = _blocks()
    assert [runs for _, _, runs in blocks].count(True) >= 1
    assert [runs for _, _, runs in blocks].count(False) >= 1  # the 0.5 code


@pytest.mark.parametrize("line", [line for line, _, runs in _blocks() if runs])
def test_guide_block_runs_as_written(line, tmp_path, monkeypatch):
    code = next(c for n, c, _ in _blocks() if n == line)
    monkeypatch.chdir(tmp_path)  # the examples save files
    scope: dict = {"__name__": "migration_guide"}
    exec(compile(code, f"{GUIDE}:{line}", "exec"), scope)  # noqa: S102
    if "GradientAccumulateModel(" in code:  # the side-by-side example
        model, restored = scope["model"], scope["restored"]
        # 2 epochs of 5 batches of 8 with accum_steps=4: per epoch one full cycle and one short
        # cycle of 1 batch, applied at the epoch end and counted.
        assert int(model.optimizer.iterations) == 4
        assert (tmp_path / "model.keras").is_file()
        x = scope["x_train"][:8]
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(restored(x, training=False)),
            keras.ops.convert_to_numpy(model(x, training=False)),
            rtol=1e-6,
            atol=1e-6,
        )
        assert int(scope["sequential"].optimizer.iterations) >= 2


def test_keras3_changes_the_guide_lists(tmp_path):
    """Keras 3 refuses a SavedModel directory name, and a Sequential has no .input/.output
    until called, while .inputs/.outputs work: the changes the guide's introduction names."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(AttributeError):
        model.input  # noqa: B018
    assert len(model.inputs) == 1 and len(model.outputs) == 1
    with pytest.raises(ValueError, match=r"\.keras"):
        model.save(str(tmp_path / "model"))
