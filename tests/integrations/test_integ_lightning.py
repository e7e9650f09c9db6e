"""Lightning with the real library: exact big batch, step counters, BN statistics, resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

L = pytest.importorskip("lightning")

from gradient_accumulator.torch import GradientAccumulateOptimizer, convert_batchnorm  # noqa: E402
from gradient_accumulator.torch.lightning import accumulation_step  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    # Lightning 2.6 still uses torch's deprecated pytree LeafSpec.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

K, B, N = 3, 4, 56  # 14 micro-batches an epoch: 4 full cycles and a short one of 2
EPOCHS = 2
LR, WD, CLIP, WARMUP = 1e-2, 0.05, 0.5, 3
UPDATES_PER_EPOCH = math.ceil(math.ceil(N / B) / K)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP) * 0.9 ** max(0, step - WARMUP)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g) * 1.5 + 0.5
    y = torch.randn(N, 2, generator=g)
    return x, y


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = convert_batchnorm(_net(), K)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss)
        accumulation_step(self, batch_idx, weight=len(x))

    def configure_optimizers(self):
        inner = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        opt = GradientAccumulateOptimizer(inner, K, max_grad_norm=CLIP)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    x, y = _data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)


def _trainer(epochs: int, tmp_path=None) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def _ghost_bn(bn: nn.BatchNorm1d, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Big-batch reference: each micro-batch normalised by its own statistics (as in training),
    running statistics updated once from the whole big batch."""
    out = torch.cat(
        [F.batch_norm(c, None, None, bn.weight, bn.bias, True, 0.0, bn.eps) for c in x.split(sizes)]
    )
    with torch.no_grad():
        xd = x.detach().double()
        m = bn.momentum
        bn.running_mean.mul_(1 - m).add_(m * xd.mean(0).float())
        bn.running_var.mul_(1 - m).add_(m * xd.var(0, unbiased=True).float())
        bn.num_batches_tracked += 1
    return out


def _reference():
    """One AdamW step per big batch (all the cycle's samples), clipping and warm-up included."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    x, y = _data()
    for _ in range(EPOCHS):
        for start in range(0, N, K * B):
            xb, yb = x[start : start + K * B], y[start : start + K * B]
            sizes = [len(c) for c in xb.split(B)]
            h = _ghost_bn(net[1], net[0](xb), sizes)
            loss = F.mse_loss(net[3](net[2](h)), yb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return net


def _assert_close(model: Net, ref: nn.Module) -> None:
    ours = dict(model.net.named_parameters())
    scale = max(p.abs().max().item() for p in ref.parameters())
    for name, p in ref.named_parameters():
        assert (ours[name] - p).abs().max().item() <= 1e-5 * scale, name
    for name in ("running_mean", "running_var"):
        a, b = getattr(model.net[1], name), getattr(ref[1], name)
        assert (a - b).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item()), name
    assert int(model.net[1].num_batches_tracked) == int(ref[1].num_batches_tracked)


def test_lightning_matches_the_big_batch():
    model = Net()
    trainer = _trainer(EPOCHS)
    trainer.fit(model, _loader())
    assert trainer.global_step == EPOCHS * UPDATES_PER_EPOCH  # updates, not micro-batches
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == EPOCHS * UPDATES_PER_EPOCH
    wrapper = trainer.optimizers[0]
    assert wrapper.accumulation_state.updates == EPOCHS * UPDATES_PER_EPOCH
    assert wrapper.micro_step == 0
    _assert_close(model, _reference())


def test_lightning_resume_is_bit_exact(tmp_path):
    straight = Net()
    _trainer(EPOCHS).fit(straight, _loader())
    first = Net()
    t1 = _trainer(1, tmp_path)
    t1.fit(first, _loader())
    ckpt = tmp_path / "one_epoch.ckpt"
    t1.save_checkpoint(ckpt)
    resumed = Net()
    t2 = _trainer(EPOCHS, tmp_path)
    t2.fit(resumed, _loader(), ckpt_path=ckpt)
    assert t2.global_step == EPOCHS * UPDATES_PER_EPOCH
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    sa = t2.optimizers[0].state_dict()["optimizer"]["state"]
    sb = _trainer_state(straight)
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)


def _trainer_state(module: Net):
    return module.trainer.optimizers[0].state_dict()["optimizer"]["state"]


class _ProxyNet(Net):
    """Drives the wrapper through Lightning's proxy directly (self.optimizers())."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y))
        opt.step(weight=len(x))
        opt.zero_grad()
        if batch_idx + 1 == self.trainer.num_training_batches:
            assert opt.flush()
            assert opt.update_applied
        self.seen.append((opt.micro_step, opt.accumulation_state.updates, opt.update_applied))


def test_flush_and_update_applied_through_the_proxy():
    model = _ProxyNet()
    trainer = _trainer(1)
    trainer.fit(model, _loader())
    real = trainer.optimizers[0]
    assert real.micro_step == 0
    assert real.accumulation_state.updates == UPDATES_PER_EPOCH
    assert trainer.global_step == UPDATES_PER_EPOCH
    # The proxy reports the real wrapper's state after every micro-batch.
    expected = [((i + 1) % K, (i + 1) // K, (i + 1) % K == 0) for i in range(13)]
    expected.append((0, UPDATES_PER_EPOCH, True))
    assert model.seen == expected


class _AutoNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)


def test_automatic_optimization_is_refused_clearly():
    with pytest.raises(RuntimeError, match="manual optimization"):
        _trainer(1).fit(_AutoNet(), _loader())
