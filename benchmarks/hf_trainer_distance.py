"""How far the Hugging Face Trainer lands from the token-exact big batch: ours and the stock one.

The setup is ``tests/integrations/test_integ_transformers.py``'s (imported from there, not
copied): a tiny ``GPT2LMHeadModel`` from its config, 21 padded variable-length sequences,
micro-batches of 2, ``gradient_accumulation_steps=3``, 3 epochs = 12 updates, CPU, fp32. Two
trainings, each against its own token-exact big batch (one update per cycle on the cycle's
summed token losses / its target tokens):

* ``adamw``: AdamW, linear warm-up, ``max_grad_norm=0.5`` (``test_trainer_is_token_exact``);
* ``sgd``: plain SGD, lr 0.5, constant, no clipping (the test's ``test_subclass_...``).

For each it prints max|Δw| from the big batch for ``GradientAccumulationTrainer`` and for the
stock ``Trainer`` with the same ``gradient_accumulation_steps``; with ``--loss-type`` also for the
stock Trainer on a model whose ``loss_type`` is set to ``"ForCausalLM"`` (the Trainer then counts
the shifted labels: ``GPT2LMHeadModel``'s ``loss_type`` is None, and the stock Trainer divides by
the unshifted count, one token too many per sequence).

With ``--setup example`` the data, model and training are ``examples/hf_gpt2.py``'s instead
(imported from it): its char-level GPT-2 on Python's ``textwrap`` source, 10 updates of 4 x 4
lines, AdamW (lr 3e-3, weight decay 0.01 on every parameter), linear warm-up, clipping at 1.0;
the reference is the example's own big batch. (``sgd`` there: its model and data with the
``sgd`` settings above.)

Usage: PYTHONPATH=. python benchmarks/hf_trainer_distance.py [--loss-type] [--setup example]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
sys.path.insert(0, str(ROOT / "examples"))
import hf_gpt2 as example  # noqa: E402
import test_integ_transformers as setup  # noqa: E402

from gradient_accumulator.torch import GradientAccumulateOptimizer  # noqa: E402

SETTINGS = {
    "adamw": {},
    "sgd": dict(
        optim="sgd",
        learning_rate=setup.SGD_LR,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    ),
}


def _train(cls, optim: str, out: str, loss_type: str | None = None) -> tuple[torch.Tensor, int]:
    model = setup._model()
    if loss_type is not None:
        model.loss_type = loss_type
    trainer = cls(
        model=model,
        args=setup._args(out, **SETTINGS[optim]),
        train_dataset=setup._Data(),
        data_collator=setup.collate,
    )
    trainer.train()
    return setup._flat(trainer.model), trainer.state.global_step


class _Lines(torch.utils.data.Dataset):
    def __init__(self, seqs: list[torch.Tensor]) -> None:
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.seqs[i]}


def _example_run(cls, optim: str, out: str, loss_type: str | None, updates: int = 10):
    """``examples/hf_gpt2.py``'s training through a Trainer (``cls``), and its big batch."""
    accum, batch = 4, 4
    seqs, vocab = example.encode(example.corpus_lines(48))
    seqs = seqs[: updates * accum * batch]
    model = example.make_model(vocab)
    if loss_type is not None:
        model.loss_type = loss_type
    if optim == "adamw":
        opt, clip = example.make_optimizer(model), 1.0
    else:
        opt, clip = torch.optim.SGD(model.parameters(), lr=setup.SGD_LR), 0.0
    if cls is setup.OursInOrder:
        opt = GradientAccumulateOptimizer(opt, accum, max_grad_norm=clip or None)
    if optim == "adamw":
        sched = transformers.get_linear_schedule_with_warmup(opt, max(1, updates // 4), updates)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    trainer = cls(
        model=model,
        args=setup._args(
            out,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accum,
            num_train_epochs=1,
            max_grad_norm=clip,
        ),
        train_dataset=_Lines(seqs),
        data_collator=lambda items: example.pad([it["input_ids"] for it in items]),
        optimizers=(opt, sched),
    )
    trainer.train()
    assert trainer.state.global_step == updates
    return example.flat(trainer.model)


def _example_reference(optim: str, updates: int = 10) -> torch.Tensor:
    accum, batch = 4, 4
    seqs, vocab = example.encode(example.corpus_lines(48))
    micro = [example.pad(seqs[i : i + batch]) for i in range(0, updates * accum * batch, batch)]
    cycles = [micro[i : i + accum] for i in range(0, len(micro), accum)]
    if optim == "adamw":
        return example.run("big", cycles, vocab, 1.0, False)[0]
    model = example.make_model(vocab)
    opt = torch.optim.SGD(model.parameters(), lr=setup.SGD_LR)
    for cycle in cycles:
        tokens = sum(example.target_tokens(b) for b in cycle)
        (sum(example.token_loss_sum(model, b, vocab) for b in cycle) / tokens).backward()
        opt.step()
        opt.zero_grad()
    return example.flat(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss-type", action="store_true", help="also loss_type='ForCausalLM'")
    parser.add_argument("--setup", choices=("test", "example"), default="test")
    args = parser.parse_args(argv)
    where = (
        f"the test's setup, {setup.EPOCHS} epochs, gradient_accumulation_steps={setup.K}"
        if args.setup == "test"
        else "examples/hf_gpt2.py's setup, 10 updates, gradient_accumulation_steps=4"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}; tiny GPT2LMHeadModel "
        f"(loss_type {setup._model().loss_type!r}), {where}"
    )
    with tempfile.TemporaryDirectory() as out:
        for optim in SETTINGS:
            runs = {"GradientAccumulationTrainer": (setup.OursInOrder, None)}
            runs["stock Trainer"] = (setup.TrainerInOrder, None)
            if args.loss_type:
                runs["stock Trainer, loss_type='ForCausalLM'"] = (
                    setup.TrainerInOrder,
                    "ForCausalLM",
                )
            if args.setup == "example":
                results = {
                    label: (_example_run(cls, optim, out, lt), 10)
                    for label, (cls, lt) in runs.items()
                }
                ref, ref_updates = _example_reference(optim), 10
                print(f"{optim}: {ref_updates} updates, max|w| {ref.abs().max().item():.3f}")
                for label, (w, _) in results.items():
                    d = (w - ref).abs().max().item()
                    print(f"  {label:>40}: max|dw| from the token-exact big batch {d:.2e}")
                continue
            results = {label: _train(cls, optim, out, lt) for label, (cls, lt) in runs.items()}
            updates = {n for _, n in results.values()}
            assert len(updates) == 1, updates
            ref, ref_updates, _ = setup._token_exact_big_batch(updates.pop(), optim)
            scale = ref.abs().max().item()
            print(f"{optim}: {ref_updates} updates, max|w| {scale:.3f}")
            for label, (w, _) in results.items():
                d = (w - ref).abs().max().item()
                print(f"  {label:>40}: max|dw| from the token-exact big batch {d:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
