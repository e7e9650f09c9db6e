"""``gradient_accumulator.core`` imports no framework; CUDA tensors reach the kernels through the
CUDA adapter of their framework (its stream, its device guard, its result tensors).

The adapter tests use fake CUDA tensors (DLPack capsules that say "CUDA device 0", see
``helpers.FakeCudaTensor``) and a recording adapter registered for their module; a recording
wrapper around the binding shows what reached it. Without a GPU the binding then refuses, as in
``test_core_cuda_dispatch.py``.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import FakeCudaTensor

from gradient_accumulator import core

FRAMEWORKS = ("torch", "tensorflow", "jax", "keras")

#: The top-level module the fake tensors' type lives in: what the core matches adapters by.
FAKE_FRAMEWORK = FakeCudaTensor.__module__.split(".")[0]

#: A real GPU with a CUDA build: the fake tensors would reach the device (tests/cuda covers it).
REAL_GPU = core.has_cuda() and core.cuda_device_count() > 0

STREAM = 0x5EED


#: What the binding says when a valid CUDA call cannot run: no device, or no CUDA kernels.
FAILURE = "CUDA" if core.has_cuda() else "no CUDA kernels"


# ---- no framework in core.py -------------------------------------------------------------


def test_core_py_has_no_framework_import_anywhere():
    tree = ast.parse(pathlib.Path(core.__file__).read_text(encoding="utf-8"))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
        elif isinstance(node, ast.Call):  # importlib.import_module("x") / __import__("x")
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    imported.append(arg.value)
    assert "numpy" in imported and "importlib" in imported  # the walk sees what is there
    found = [m for m in imported if m.split(".")[0] in FRAMEWORKS]
    assert found == [], f"core.py imports {found}"


_CPU_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import numpy as np
    import gradient_accumulator.core as core

    f32 = np.float32
    acc = [np.zeros(3, f32)]
    r = core.accumulate(acc, [np.ones(3, f32)], weight=2.0, overwrite=True, compute_sumsq=True)
    core.accumulate(acc, [np.ones(3, f32)], weight=2.0)
    out = {"acc": acc[0].tolist(), "nonfinite": r.nonfinite, "sumsq": r.sumsq}
    out["norm"] = core.global_norm([np.array([3.0], f32), np.array([4.0], f32)])
    out["sumsq2"] = core.sum_of_squares([np.array([1.0, 2.0], f32)])
    out["units"] = core.unitwise_norm(np.array([[3.0, 4.0], [0.0, 1.0]], f32)).tolist()
    p, a = [np.ones(2, f32)], [np.full(2, 4.0, f32)]
    res = core.apply(p, a, optimizer="sgd", lr=0.5, grad_scale=0.25, max_norm=10.0)
    out["param"], out["acc_after"] = p[0].tolist(), a[0].tolist()
    out["grad_norm"] = float(res.grad_norm)
    g = [np.full((2, 2), 10.0, f32)]
    core.adaptive_clip([np.ones((2, 2), f32)], g, clip_factor=0.5, eps=0.0)
    out["clipped"] = g[0].tolist()
    x = np.arange(12, dtype=f32).reshape(3, 2, 2)
    mean, m2, count = core.bn_moments(x, channels_axis=1)
    mean_b, m2_b, count_b = core.bn_moments(x + 1, channels_axis=1)
    out["count"] = core.bn_merge(count, mean, m2, count_b, mean_b, m2_b)
    rm, rv = np.zeros(2, f32), np.ones(2, f32)
    core.bn_update_running(rm, rv, mean, m2, out["count"], momentum=1.0, unbiased=False)
    out["running"] = rm.tolist() + rv.tolist()
    core.zero(acc)
    out["zeroed"] = acc[0].tolist()
    frameworks = sys.argv[1:]
    out["installed"] = [m for m in frameworks if importlib.util.find_spec(m) is not None]
    out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in frameworks)
    print(json.dumps(out))
    """
)


def test_cpu_calls_import_no_framework():
    """Every op on NumPy arrays in a fresh interpreter: right results, and no framework module
    loaded — not even the PyTorch adapter, which would pull torch."""
    done = subprocess.run(
        [sys.executable, "-c", _CPU_SCRIPT, *FRAMEWORKS],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["acc"] == [4.0, 4.0, 4.0] and out["nonfinite"] is False and out["sumsq"] == 12.0
    assert out["norm"] == 5.0 and out["sumsq2"] == 5.0
    assert out["units"] == [5.0, 1.0]
    assert out["param"] == [0.5, 0.5] and out["acc_after"] == [0.0, 0.0]
    assert out["grad_norm"] == pytest.approx(np.sqrt(2.0))
    # AGC: each unit (row) is clipped to 0.5·‖w_u‖ = 0.5·√2, i.e. every element to 0.5.
    np.testing.assert_allclose(out["clipped"], [[0.5, 0.5], [0.5, 0.5]], rtol=1e-6)
    assert out["count"] == 12.0
    # Channel c of x holds {4k + 2c, 4k + 2c + 1}; of x + 1 those plus 1: mean 4.5 + 2c + 0.5.
    np.testing.assert_allclose(out["running"][:2], [5.0, 7.0], rtol=1e-6)
    assert out["running"][2] == pytest.approx(out["running"][3]) and out["running"][2] > 0
    assert out["zeroed"] == [0.0, 0.0, 0.0]
    assert out["loaded"] == [], f"the CPU path imported {out['loaded']}"
    if "torch" not in out["installed"]:
        pytest.skip("torch is not installed: nothing could have pulled it")


def test_core_docstring_examples():
    result = doctest.testmod(core, extraglobs={"core": core}, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest lines failed"
    assert result.attempted > 0


# ---- the adapter registry ----------------------------------------------------------------


class RecordingAdapter:
    """A CUDA adapter that records what the core asks of it; its tensors are fake CUDA ones."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.inside: list = []  # the tensors whose device is current now

    def stream(self, t):
        self.calls.append(("stream", t))
        return STREAM

    @contextlib.contextmanager
    def _current(self, t):
        self.calls.append(("enter", t))
        self.inside.append(t)
        try:
            yield
        finally:
            self.inside.pop()
            self.calls.append(("exit", t))

    def device(self, t):
        self.calls.append(("device", t))
        return self._current(t)

    def empty(self, like, dtype, shape, fill):
        n = int(np.prod(shape)) if shape else 1
        out = FakeCudaTensor(n, bits=64 if dtype == "float64" else 32)
        self.calls.append(("empty", like, dtype, shape, fill, out))
        return out

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def empties(self) -> list[tuple]:
        return [c[1:5] for c in self.calls if c[0] == "empty"]


class RecordingBinding:
    """The compiled module, with each call recorded (with the adapter's current devices)."""

    def __init__(self, lib, adapter: RecordingAdapter) -> None:
        self.lib, self.adapter, self.calls = lib, adapter, []

    def __getattr__(self, name):
        target = getattr(self.lib, name)
        if name[0].isupper() or not callable(target):
            return target

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs, list(self.adapter.inside)))
            return target(*args, **kwargs)

        return call


@pytest.fixture
def registry():
    """The registry as it was, restored after the test."""
    saved = dict(core._CUDA_ADAPTERS)
    yield core._CUDA_ADAPTERS
    core._CUDA_ADAPTERS.clear()
    core._CUDA_ADAPTERS.update(saved)


@pytest.fixture
def fake(registry, monkeypatch):
    """A recording adapter registered for the fake tensors, and the recorded binding."""
    if REAL_GPU:
        pytest.skip("a real GPU is present: the fake tensors' stream would reach the device")
    adapter = RecordingAdapter()
    core.register_cuda_adapter(FAKE_FRAMEWORK, adapter)
    binding = RecordingBinding(core.load_core(), adapter)
    monkeypatch.setattr(core, "load_core", lambda: binding)
    return adapter, binding


def _only_call(binding: RecordingBinding, name: str):
    calls = [c for c in binding.calls if c[0] == name]
    assert len(calls) == 1, binding.calls
    return calls[0]


def test_accumulate_asks_the_adapter(fake):
    adapter, binding = fake
    acc, g = FakeCudaTensor(10), FakeCudaTensor(10, bits=16, code=4)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.accumulate([acc], [g], overwrite=True, compute_sumsq=True)
    assert ("stream", acc) in adapter.calls
    assert adapter.empties() == [(acc, "float32", (), 0.0), (acc, "float64", (), None)]
    flag, sumsq = (c[5] for c in adapter.calls if c[0] == "empty")
    name, args, kwargs, inside = _only_call(binding, "accumulate")
    assert args[0] == [acc] and args[1] == [g]
    assert kwargs["stream"] == STREAM
    assert kwargs["nonfinite_out"] is flag and kwargs["sumsq_out"] is sumsq
    assert inside == [acc]  # the binding ran with acc's device current
    assert adapter.kinds()[-2:] == ["enter", "exit"] and adapter.inside == []


def test_accumulate_uses_a_given_flag_and_allocates_nothing_else(fake):
    adapter, binding = fake
    acc, flag = FakeCudaTensor(4), FakeCudaTensor(1)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.accumulate([acc], [FakeCudaTensor(4)], nonfinite_out=flag)
    assert adapter.empties() == []
    assert _only_call(binding, "accumulate")[2]["nonfinite_out"] is flag


def test_sum_of_squares_and_global_norm_ask_the_adapter(fake):
    adapter, binding = fake
    t = FakeCudaTensor(6)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.global_norm([t, FakeCudaTensor(2)])
    assert adapter.empties() == [(t, "float64", (), None)]
    _, _, kwargs, inside = _only_call(binding, "sum_of_squares")
    assert kwargs["stream"] == STREAM and kwargs["out"] is adapter.calls[1][5]
    assert inside == [t]
    assert adapter.kinds() == ["stream", "empty", "device", "enter", "exit"]


def test_zero_asks_for_stream_and_device_only(fake):
    adapter, binding = fake
    t = FakeCudaTensor(5)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.zero([t])
    assert sorted(adapter.kinds()) == ["device", "enter", "exit", "stream"]
    assert all(c[1] is t for c in adapter.calls)
    _, _, kwargs, inside = _only_call(binding, "zero")
    assert kwargs["stream"] == STREAM and inside == [t]


def test_apply_gets_its_statistics_tensor_from_the_adapter(fake):
    adapter, binding = fake
    p, a = FakeCudaTensor(4), FakeCudaTensor(4)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.apply([p], [a], optimizer="sgd", lr=0.1)
    assert adapter.empties() == [(a, "float32", (3,), None)]
    _, _, kwargs, inside = _only_call(binding, "apply")
    assert kwargs["stream"] == STREAM and inside == [a]
    assert kwargs["stats_out"] is adapter.calls[-4][5]  # empty, device, enter, exit


@pytest.mark.parametrize("units", [1, 3])
def test_unitwise_norm_output_is_one_dimensional(fake, units):
    adapter, binding = fake
    t = FakeCudaTensor(12)
    t.shape = (units, 12 // units)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.unitwise_norm(t)
    assert adapter.empties() == [(t, "float32", (units,), None)]
    _, args, kwargs, inside = _only_call(binding, "unitwise_norm")
    assert args[2] == units and kwargs["stream"] == STREAM and inside == [t]


def test_adaptive_clip_and_batch_norm_ops_ask_the_adapter(fake):
    adapter, binding = fake
    # Valid arguments (distinct buffers, matching sizes): a build with CUDA kernels validates
    # them before it reaches the runtime, which then fails for want of a device.
    rm, rv, m, m2 = (FakeCudaTensor(2) for _ in range(4))
    with pytest.raises(RuntimeError, match=FAILURE):
        core.bn_update_running(rm, rv, m, m2, 4.0, momentum=0.1, unbiased=True)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.bn_merge(4.0, m, m2, 4.0, FakeCudaTensor(2), FakeCudaTensor(2))
    p, g = FakeCudaTensor(4), FakeCudaTensor(4)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.adaptive_clip([p], [g], eps=0.0)
    names = [c[0] for c in binding.calls]
    assert names == ["bn_update_running", "bn_merge", "adaptive_clip"]
    assert [c[3] for c in binding.calls] == [[rm], [m], [g]]
    assert all(c[2]["stream"] == STREAM for c in binding.calls)
    assert adapter.empties() == []


def test_numpy_arrays_never_reach_an_adapter(fake):
    adapter, binding = fake
    acc = [np.zeros(3, np.float32)]
    r = core.accumulate(acc, [np.ones(3, np.float32)], overwrite=True, compute_sumsq=True)
    assert r == (False, 3.0)
    core.zero(acc)
    assert core.sum_of_squares(acc) == 0.0
    assert adapter.calls == []
    assert [c[2].get("stream", 0) for c in binding.calls] == [0, 0, 0]


def test_a_subclass_finds_its_base_class_adapter(fake, registry):
    adapter, binding = fake
    sub_type = type("Sub", (FakeCudaTensor,), {"__module__": "someframework.tensors"})
    t = sub_type(3)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.zero([t])
    assert ("stream", t) in adapter.calls
    own = RecordingAdapter()  # an adapter of the subclass's own framework comes first
    core.register_cuda_adapter("someframework", own)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.zero([t])
    assert ("stream", t) in own.calls and len(adapter.calls) == 4


def test_cuda_tensors_without_an_adapter_name_register_cuda_adapter(registry):
    registry.pop(FAKE_FRAMEWORK, None)
    with pytest.raises(TypeError, match=rf"PyTorch.*register_cuda_adapter\('{FAKE_FRAMEWORK}'"):
        core.zero([FakeCudaTensor(3)])


def test_the_adapter_module_is_imported_on_first_need(registry, monkeypatch, tmp_path):
    """What the core does for "torch", with a module of the test's own: imported once, on the
    first CUDA tensor, it registers the adapter that the call then uses."""
    if REAL_GPU:
        pytest.skip("a real GPU is present: the fake tensors' stream would reach the device")
    registry.pop(FAKE_FRAMEWORK, None)
    (tmp_path / "ga_test_adapter.py").write_text(
        textwrap.dedent(
            f"""
            import contextlib
            from gradient_accumulator import core

            class Adapter:
                def __init__(self):
                    self.streams = []

                def stream(self, t):
                    self.streams.append(t)
                    return {STREAM}

                def device(self, t):
                    return contextlib.nullcontext()

                def empty(self, like, dtype, shape, fill):
                    raise AssertionError("zero allocates nothing")

            ADAPTER = Adapter()
            core.register_cuda_adapter({FAKE_FRAMEWORK!r}, ADAPTER)
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ga_test_adapter", raising=False)
    monkeypatch.setitem(core._ADAPTER_MODULES, FAKE_FRAMEWORK, "ga_test_adapter")
    core.zero([np.zeros(2, np.float32)])
    assert "ga_test_adapter" not in sys.modules  # CPU arrays import nothing
    t = FakeCudaTensor(3)
    with pytest.raises(RuntimeError, match=FAILURE):
        core.zero([t])
    adapter = sys.modules["ga_test_adapter"].ADAPTER
    assert registry[FAKE_FRAMEWORK] is adapter and adapter.streams == [t]


class _NoEmpty:
    def stream(self, t):
        return 0

    def device(self, t):
        return contextlib.nullcontext()


@pytest.mark.parametrize(
    "framework, adapter, error, match",
    [
        (b"torch", RecordingAdapter(), TypeError, "framework must be a str"),
        (None, RecordingAdapter(), TypeError, "framework must be a str"),
        ("", RecordingAdapter(), ValueError, "framework must be a top-level module name"),
        ("torch.cuda", RecordingAdapter(), ValueError, "framework must be a top-level"),
        ("fw", object(), TypeError, "adapter must have .*object lacks stream, device, empty"),
        ("fw", _NoEmpty(), TypeError, "adapter must have .*_NoEmpty lacks empty$"),
    ],
)
def test_bad_registrations_are_refused(registry, framework, adapter, error, match):
    before = dict(registry)
    with pytest.raises(error, match=match):
        core.register_cuda_adapter(framework, adapter)
    assert registry == before


def test_register_cuda_adapter_is_public():
    assert "register_cuda_adapter" in core.__all__


# ---- PyTorch's adapter -------------------------------------------------------------------


def test_torch_adapter_module_registers_itself_and_is_found_lazily():
    """In a fresh interpreter: a tensor of type ``torch.*`` on CUDA makes the core import
    ``gradient_accumulator.torch._device``, whose adapter then handles the call."""
    pytest.importorskip("torch")
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])  # tests/, for the fake tensors
        from helpers import FakeCudaTensor
        from gradient_accumulator import core

        class Tensor(FakeCudaTensor):  # a CUDA tensor whose type says it is torch's
            pass

        Tensor.__module__ = "torch"
        before = "gradient_accumulator.torch._device" in sys.modules
        try:
            core.zero([Tensor(3)])
            error = ""
        except Exception as e:  # the torch adapter asks torch about a tensor torch never made
            error = type(e).__name__
        adapter = core._CUDA_ADAPTERS.get("torch")
        print(json.dumps({
            "before": before,
            "loaded": "gradient_accumulator.torch._device" in sys.modules,
            "adapter": type(adapter).__module__ + "." + type(adapter).__name__,
            "error": error,
        }))
        """
    )
    here = str(pathlib.Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", script, here],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] is False and out["loaded"] is True
    assert out["adapter"] == "gradient_accumulator.torch._device.TorchCudaAdapter"
    assert out["error"] != ""


def test_torch_adapter_empty_and_device_on_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from gradient_accumulator.torch._device import TorchCudaAdapter

    adapter = TorchCudaAdapter()
    like = torch.ones(5, dtype=torch.float16)
    flag = adapter.empty(like, "float32", (), 0.0)
    assert flag.dtype == torch.float32 and flag.shape == () and flag.item() == 0.0
    stats = adapter.empty(like, "float32", (3,), None)
    assert stats.dtype == torch.float32 and stats.shape == (3,)
    sumsq = adapter.empty(like, "float64", (), 2.5)
    assert sumsq.dtype == torch.float64 and sumsq.shape == () and sumsq.item() == 2.5
    assert adapter.empty(like, "float32", (1,), None).shape == (1,)
    assert flag.device == like.device
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'float64'"):
        adapter.empty(like, "float16", (), None)
    # A CPU tensor needs no device guard, and finding that out does not touch CUDA.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked CUDA"))
    assert isinstance(adapter.device(like), contextlib.nullcontext)
    assert isinstance(core._CUDA_ADAPTERS.get("torch"), TorchCudaAdapter)
