"""Hugging Face Trainer with the real library: token-exact accumulation of a tiny GPT-2.

CI runs this file with the newest transformers the project pins and again with the oldest its
``[integrations]`` extra allows (``GA_TRANSFORMERS_VERSION`` names the one expected).
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradient_accumulator.torch.transformers import (  # noqa: E402
    MIN_TRANSFORMERS,
    GradientAccumulationTrainer,
    check_transformers_version,
    is_causal_lm,
    target_tokens,
)

K, B, N_SEQ, LR, WD, CLIP, WARMUP = 3, 2, 21, 3e-3, 0.01, 0.5, 3  # 11 micro-batches an epoch
EPOCHS = 3  # 4 updates an epoch (3 full, 1 short), 12 in all
VOCAB = 40
SGD_LR = 0.5


def _sequences():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 17, (N_SEQ,), generator=g)
    return [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.seqs = _sequences()

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.seqs[i]}


def collate(items: list[dict]) -> dict:
    """Right-pads a micro-batch to its own longest sequence; padding is no target."""
    n = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for r, it in enumerate(items):
        ids[r, : len(it["input_ids"])] = it["input_ids"]
        mask[r, : len(it["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class MyLMHead(transformers.GPT2LMHeadModel):
    """A user's subclass of a causal LM: its class name is in no transformers mapping."""


def _config():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _model(cls=None):
    torch.manual_seed(0)
    return (cls or transformers.GPT2LMHeadModel)(_config())


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=K,
        num_train_epochs=EPOCHS,
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
        remove_unused_columns=False,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


class _InOrder:
    """Trainer mixin: micro-batches in dataset order, so that the reference sees the same data."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class OursInOrder(_InOrder, GradientAccumulationTrainer):
    pass


class TrainerInOrder(_InOrder, transformers.Trainer):
    pass


def _flat(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _token_exact_big_batch(total_updates: int, optim: str = "adamw", cls=None):
    """One update per cycle on the summed token losses / the cycle's target tokens.

    Returns the weights, the number of updates and, in fp64, the loss of each update: the
    cycle's token-weighted mean (summed token losses / the cycle's target tokens) and the plain
    mean of its micro-batches' own means (what the Trainer integration logged before).
    """
    model = _model(cls)
    if optim == "adamw":
        # The Trainer's grouping: no weight decay on biases and LayerNorm weights.
        names = set(transformers.Trainer.get_decay_parameter_names(None, model))
        decay = [p for n, p in model.named_parameters() if n in names]
        no_decay = [p for n, p in model.named_parameters() if n not in names]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.999),
            eps=1e-8,
        )
        sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, total_updates)
        clip = CLIP
    else:  # plain SGD, constant learning rate, no clipping
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        clip = None
    data = _Data()
    batches = [
        collate([data[j] for j in range(i, min(i + B, len(data)))]) for i in range(0, len(data), B)
    ]
    updates, weighted, plain = 0, [], []
    for _ in range(EPOCHS):
        for start in range(0, len(batches), K):
            cycle = batches[start : start + K]
            tokens = sum(target_tokens(b["labels"], True) for b in cycle)
            total, summed64, plain64 = 0.0, 0.0, 0.0
            for b in cycle:
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                summed = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB),
                    b["labels"][:, 1:].reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
                total = total + summed
                summed64 += summed.detach().item()  # fp32 token sums, added in fp64
                plain64 += summed.detach().item() / target_tokens(b["labels"], True) / len(cycle)
            weighted.append(summed64 / tokens)
            plain.append(plain64)
            (total / tokens).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            sched.step()
            updates += 1
    return _flat(model), updates, (weighted, plain)


def test_trainer_is_token_exact(tmp_path):
    ours = OursInOrder(
        model=_model(),
        args=_args(tmp_path, logging_strategy="steps", logging_steps=1),
        train_dataset=_Data(),
        data_collator=collate,
    )
    result = ours.train()
    updates = ours.state.global_step
    assert updates == EPOCHS * 4  # updates, not micro-batches
    assert ours.accumulator.accumulation_state.updates == updates
    assert ours.accumulator.micro_step == 0
    assert ours.lr_scheduler.last_epoch == updates
    ref, ref_updates, (ref_losses, plain_losses) = _token_exact_big_batch(updates)
    assert ref_updates == updates
    # Each update logs the loss it used: its cycle's token-weighted mean (the 4th cycle of an
    # epoch is short), neither a plain mean of the micro-batches' means nor divided by K. The
    # reference runs its own fp64-summed copy of the training, whose weights agree with ours to
    # ~1e-6 relative: 1e-5 relative on the loss.
    logged = [e["loss"] for e in ours.state.log_history if "loss" in e]
    assert logged == pytest.approx(ref_losses, rel=1e-5)
    assert result.training_loss == pytest.approx(sum(ref_losses) / updates, rel=1e-5)
    # The plain mean differs by more than the tolerance (the check can fail).
    assert max(abs(p / r - 1) for p, r in zip(plain_losses, ref_losses)) > 1e-4
    w = _flat(ours.model)

    own = TrainerInOrder(
        model=_model(), args=_args(tmp_path), train_dataset=_Data(), data_collator=collate
    )
    own.train()
    scale = ref.abs().max().item()
    d_ours = (w - ref).abs().max().item()
    d_own = (_flat(own.model) - ref).abs().max().item()
    print(
        f"max|dw| from the token-exact big batch: ours {d_ours:.3e}, Trainer's own "
        f"gradient_accumulation_steps {d_own:.3e} (max|w| {scale:.3f}, {updates} updates)"
    )
    assert d_ours <= 1e-5 * scale


def test_target_tokens_counts_shifted_labels():
    labels = torch.tensor([[5, 6, 7, -100], [1, -100, -100, -100]])
    assert target_tokens(labels, True) == 2
    assert target_tokens(labels, False) == 4


def test_bf16_model_accumulates_in_fp32_like_the_hand_loop(tmp_path):
    """A bf16 GPT-2 through the Trainer: fp32 accumulators, and the very same weights as the
    wrapper driven by hand with token weights (same micro-batches, schedule and short cycle)."""
    from gradient_accumulator.torch import GradientAccumulateOptimizer

    args = _args(tmp_path, num_train_epochs=1)
    ours = OursInOrder(
        model=_model().to(torch.bfloat16), args=args, train_dataset=_Data(), data_collator=collate
    )
    ours.train()
    assert ours.state.global_step == 4
    assert all(a.dtype == torch.float32 for a in ours.accumulator.accumulators())

    model = _model().to(torch.bfloat16)
    names = set(transformers.Trainer.get_decay_parameter_names(None, model))
    inner = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n in names], "weight_decay": WD},
            {
                "params": [p for n, p in model.named_parameters() if n not in names],
                "weight_decay": 0.0,
            },
        ],
        lr=LR,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    opt = GradientAccumulateOptimizer(inner, K, max_grad_norm=CLIP)
    sched = transformers.get_linear_schedule_with_warmup(opt, WARMUP, 4)
    data = _Data()
    for i in range(0, len(data), B):
        batch = collate([data[j] for j in range(i, min(i + B, len(data)))])
        model(**batch).loss.backward()
        opt.step(weight=target_tokens(batch["labels"], True))
        opt.zero_grad()
        if opt.update_applied:
            sched.step()
    assert opt.flush()
    sched.step()
    assert torch.equal(_flat(ours.model), _flat(model))


def test_subclass_of_a_causal_lm_is_token_exact(tmp_path):
    """A subclass of GPT2LMHeadModel still shifts its labels when counting target tokens: plain
    SGD through the Trainer lands on the token-exact big batch to float rounding."""
    ours = OursInOrder(
        model=_model(MyLMHead),
        args=_args(
            tmp_path,
            optim="sgd",
            learning_rate=SGD_LR,
            weight_decay=0.0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
        ),
        train_dataset=_Data(),
        data_collator=collate,
    )
    assert ours.shift_labels
    ours.train()
    ref, updates, _ = _token_exact_big_batch(ours.state.global_step, "sgd", MyLMHead)
    assert updates == EPOCHS * 4
    w = _flat(ours.model)
    scale = ref.abs().max().item()
    d = (w - ref).abs().max().item()
    print(f"subclass, SGD: max|dw| from the token-exact big batch {d:.3e} (max|w| {scale:.3f})")
    # Measured 1.2e-7 (one fp32 ulp of max|w| ≈ 1.01); counting unshifted labels: 5.2e-3.
    assert d <= 1e-6 * scale


def test_causal_lm_detection_reads_the_model_not_its_class_name():
    assert is_causal_lm(_model()) and is_causal_lm(_model(MyLMHead))
    assert not is_causal_lm(transformers.GPT2ForSequenceClassification(_config()))
    assert not is_causal_lm(transformers.GPT2ForTokenClassification(_config()))
    t5 = transformers.T5Config(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2
    )
    # An encoder-decoder's labels are the decoder's targets as given (its loss does not shift).
    assert not is_causal_lm(transformers.T5ForConditionalGeneration(t5))

    class Custom(transformers.PreTrainedModel):
        config_class = transformers.GPT2Config

        def __init__(self, config):
            super().__init__(config)
            self.lin = torch.nn.Linear(2, 2)

    plain = Custom(_config())
    assert not is_causal_lm(plain)  # no causal class, no causal loss function
    plain.loss_function = transformers.loss.loss_utils.ForCausalLMLoss
    assert is_causal_lm(plain)  # its forward would call the causal-LM loss
    config = _config()
    config.loss_type = "ForCausalLM"
    assert is_causal_lm(Custom(config))


def test_transformers_older_than_the_extra_allows_is_refused():
    with pytest.raises(ImportError, match=r"transformers>=5\.17, found 5\.16\.1.*pip install"):
        check_transformers_version("5.16.1")
    check_transformers_version(MIN_TRANSFORMERS)
    check_transformers_version(transformers.__version__)


@pytest.mark.skipif(
    "GA_TRANSFORMERS_VERSION" not in os.environ, reason="CI's pinned-version runs only"
)
def test_the_transformers_under_test_is_the_one_ci_pinned():
    assert transformers.__version__ == os.environ["GA_TRANSFORMERS_VERSION"]


class _ScalesTheLoss(transformers.Trainer):
    """A Trainer whose training_step scales the loss in a way ours does not know of."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs)) * 0.5
        self.accelerator.backward(loss)
        return loss.detach()


class _OursOverScaling(_InOrder, GradientAccumulationTrainer, _ScalesTheLoss):
    pass


def test_a_loss_scaled_by_the_trainer_is_refused_before_anything_is_accumulated(tmp_path):
    trainer = _OursOverScaling(
        model=_model(), args=_args(tmp_path), train_dataset=_Data(), data_collator=collate
    )
    before = _flat(trainer.model).clone()
    with pytest.raises(RuntimeError, match=r"scaled the micro-batch's loss by 0\.5"):
        trainer.train()
    assert trainer.accumulator.micro_step == 0
    assert trainer.accumulator.accumulation_state.updates == 0
    assert torch.equal(_flat(trainer.model), before)
