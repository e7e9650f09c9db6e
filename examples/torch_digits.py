"""A small CNN with batch norm on scikit-learn's digits: 8 micro-batches of 8 vs batches of 64.

Two copies of the same network start from the same weights and train for 5 epochs:

* ``accumulated``: micro-batches of 8, ``GradientAccumulateOptimizer(SGD, accum_steps=8)`` and
  ``AccumBatchNorm2d`` layers registered with it (``convert_batchnorm(model, optimizer)``), the
  epoch's short last cycle applied with its true weight (``flush``);
* ``big batch``: batches of 64 with a plain ``SGD`` (Nesterov momentum, weight decay). Its
  batch-norm layers normalise each group of 8 samples with that group's statistics (the most a
  micro-batch can see) and update their running statistics from all 64: the exact target of
  accumulation.

Equivalence is checked update by update: before every cycle the accumulated model's weights,
running statistics and momentum buffers are copied into a plain big-batch model, which then takes
the big batch's step; the largest weight and running-statistic difference over all updates is
fp32 rounding (~1e-7 relative). The two independent runs are compared by test accuracy; their
weights drift apart by much more than one update's rounding, because training at this learning
rate amplifies rounding: two plain fp32 big-batch runs that differ only in summation order drift
apart as much. (SGD, not Adam, makes the comparison meaningful element by element: Adam divides
each coordinate by its own RMS, so a coordinate whose gradient is pure rounding noise — a dead
ReLU unit — moves by up to the learning rate in both runs, whatever the summation order.) The
data ships with scikit-learn: nothing is downloaded.

Run: ``python examples/torch_digits.py [--epochs 5] [--seed 0]``
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

from gradient_accumulator.torch import (
    GradientAccumulateOptimizer,
    convert_batchnorm,
)

MICRO_BATCH = 8
ACCUM_STEPS = 8


class GroupStatsBatchNorm2d(nn.BatchNorm2d):
    """Reference layer: normalise each group of ``group`` samples with its own statistics and
    update the running statistics once from the whole batch (what accumulation reproduces)."""

    def __init__(self, num_features: int, group: int):
        super().__init__(num_features)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        outs = [
            F.batch_norm(chunk, None, None, self.weight, self.bias, True, 0.0, self.eps)
            for chunk in x.split(self.group)
        ]
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            mean = x.double().mean(dim=(0, 2, 3))
            var = x.double().var(dim=(0, 2, 3), unbiased=True) if n > 1 else None
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.float())
            if var is not None:
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var.float())
            self.num_batches_tracked += 1
        return torch.cat(outs)


def max_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if "running" in name]


def make_model(bn: type[nn.Module] = nn.BatchNorm2d, **bn_kwargs) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        bn(16, **bn_kwargs),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        bn(32, **bn_kwargs),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4, 10),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=args.seed, stratify=digits.target
    )
    x_train, y_train = x[idx_train], y[idx_train]
    x_test, y_test = x[idx_test], y[idx_test]
    big = MICRO_BATCH * ACCUM_STEPS

    reference = make_model(GroupStatsBatchNorm2d, group=MICRO_BATCH)
    accumulated = make_model()
    accumulated.load_state_dict(reference.state_dict())

    def make_opt(params):
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)

    def big_batch_from_accumulated() -> tuple[nn.Module, torch.optim.Optimizer]:
        """A plain big-batch model and optimizer in the accumulated run's current state."""
        model = make_model(GroupStatsBatchNorm2d, group=MICRO_BATCH)
        model.load_state_dict(accumulated.state_dict(), strict=False)  # minus the cycle buffers
        opt = make_opt(model.parameters())
        for p, q in zip(accumulated.parameters(), model.parameters()):
            buf = acc_opt.state[p].get("momentum_buffer")
            if buf is not None:
                opt.state[q]["momentum_buffer"] = buf.clone()
        return model, opt

    ref_opt = make_opt(reference.parameters())
    acc_opt = GradientAccumulateOptimizer(make_opt(accumulated.parameters()), ACCUM_STEPS)
    # BatchNorm2d → AccumBatchNorm2d, registered with acc_opt: the layers follow its cycle, and
    # acc_opt.flush() folds their partial cycle too.
    accumulated = convert_batchnorm(accumulated, acc_opt)

    weight_diff = weight_max = stats_diff = 0.0
    start = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_train), generator=g)
        batches = [order[i : i + big] for i in range(0, len(order), big)]
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", leave=False)
        for batch in bar:
            xb, yb = x_train[batch], y_train[batch]
            check, check_opt = big_batch_from_accumulated()
            # Big batch: one step on all samples (mean loss).
            F.cross_entropy(reference(xb), yb).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            # Accumulated: micro-batches of 8, each weighted by its size.
            for xm, ym in zip(xb.split(MICRO_BATCH), yb.split(MICRO_BATCH)):
                loss = F.cross_entropy(accumulated(xm), ym)
                loss.backward()
                acc_opt.step(weight=len(ym))
                acc_opt.zero_grad()
            # A short last batch leaves a partial cycle: apply it with its true weight.
            acc_opt.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            # The big batch's update from the same state, for the per-update comparison.
            F.cross_entropy(check(xb), yb).backward()
            check_opt.step()
            weight_diff = max(weight_diff, max_diff(accumulated.parameters(), check.parameters()))
            weight_max = max(weight_max, *(p.abs().max().item() for p in check.parameters()))
            stats_diff = max(stats_diff, max_diff(running_stats(accumulated), running_stats(check)))
    elapsed = time.perf_counter() - start

    drift = max_diff(accumulated.parameters(), reference.parameters())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"gradient accumulation: {ACCUM_STEPS} micro-batches of {MICRO_BATCH} "
        f"vs batches of {big}, {args.epochs} epochs, {acc_opt.accumulation_state.updates} "
        f"updates, {elapsed:.1f} s"
    )
    print("each update against the big batch's update from the same state:")
    print(
        f"largest weight difference:        {weight_diff:.3e} "
        f"(relative {weight_diff / weight_max:.3e})"
    )
    print(f"largest running-stat difference:  {stats_diff:.3e}")
    print(
        f"after {args.epochs} epochs, trained independently: test accuracy accumulated "
        f"{accuracy(accumulated, x_test, y_test):.4f}, big batch "
        f"{accuracy(reference, x_test, y_test):.4f}; weights {drift:.1e} apart (fp32 rounding "
        "amplified by training)"
    )
    print(f"peak memory (process RSS): {peak_mib:.0f} MiB")
    ok = weight_diff / weight_max <= 1e-5
    print("equivalent to the big batch" if ok else "NOT equivalent to the big batch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
