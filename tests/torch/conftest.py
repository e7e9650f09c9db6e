"""Fixtures for the PyTorch adapter tests: a tiny model factory, data and an error measure."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

FEATURES, HIDDEN, OUTPUTS = 6, 16, 3


def _rel_err(a, b) -> float:
    """max|a − b| / max|b| over tensors (or lists of tensors), computed in fp64."""
    if isinstance(a, (list, tuple)):
        num = max(
            (x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b)
        )
        den = max(y.detach().double().abs().max().item() for y in b)
    else:
        num = (a.detach().double() - b.detach().double()).abs().max().item()
        den = b.detach().double().abs().max().item()
    return num / max(den, 1e-300)


@pytest.fixture
def rel_err():
    """max|a − b| / max|b| (fp64), for tensors or lists of tensors."""
    return _rel_err


class TinyMLP(nn.Module):
    """Linear → tanh → Linear: one hidden layer, the final Linear last in registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _make_pair(seed: int = 0, cls=TinyMLP):
    """An fp32 model and an fp64 deep copy with the same weights."""
    torch.manual_seed(seed)
    model = cls()
    return model, copy.deepcopy(model).double()


@pytest.fixture
def make_pair():
    """Factory: ``make_pair(seed=0, cls=TinyMLP)`` → (fp32 model, fp64 copy)."""
    return _make_pair


def _make_data(n: int, seed: int = 1, features: int = FEATURES, outputs: int = OUTPUTS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randn(n, outputs, generator=g) + 0.5
    return x, y


@pytest.fixture
def make_data():
    """Factory: ``make_data(n, seed=1)`` → (x, y) in fp32."""
    return _make_data


def _mse(model, x, y):
    """Mean squared error over the batch (in the model's dtype)."""
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)) - y.to(dtype)).square().mean()


@pytest.fixture
def mse():
    """``mse(model, x, y)``: the mean loss over a batch, cast to the model's dtype."""
    return _mse


class TinyConvNet(nn.Module):
    """Conv2d (rank-4 weight) → tanh → Linear on (N, 2, 4, 4) inputs; the Linear is final."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, OUTPUTS)

    def forward(self, x):
        x = x.reshape(x.shape[0], 2, 4, 4)
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


@pytest.fixture
def conv_cls():
    """The TinyConvNet class (inputs: 32 features, reshaped to (2, 4, 4))."""
    return TinyConvNet


def _agc_reference(params, clip_factor: float, eps: float) -> None:
    """NFNets AGC written with plain torch ops, in the parameters' own dtype.

    Units: dims 1.. for rank ≥ 2 (one unit per output), the whole tensor for rank ≤ 1.
    g ← g · min(1, λ·max(‖w‖, ε) / max(‖g‖, 1e-6)).
    """
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            if p.dim() <= 1:
                wn = p.norm().clamp_min(eps)
                gn = p.grad.norm().clamp_min(1e-6)
            else:
                dims = tuple(range(1, p.dim()))
                wn = torch.linalg.vector_norm(p, dim=dims, keepdim=True).clamp_min(eps)
                gn = torch.linalg.vector_norm(p.grad, dim=dims, keepdim=True).clamp_min(1e-6)
            p.grad.mul_(torch.clamp(clip_factor * wn / gn, max=1.0))


@pytest.fixture
def agc_reference():
    """``agc_reference(params, clip_factor, eps)``: independent AGC on ``.grad`` in place."""
    return _agc_reference
