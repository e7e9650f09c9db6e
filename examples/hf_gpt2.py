"""A small GPT-2 trained character-level with token-exact gradient accumulation.

The text is the source of Python's own ``textwrap`` module (no download). Lines of different
lengths make micro-batches with different numbers of target tokens, padded to their own longest
line. Three runs from the same initial weights see the same micro-batches:

* big batch: one update per cycle on the cycle's summed token losses / its token count (exact);
* ours: ``GradientAccumulateOptimizer`` with ``step(weight=<target tokens>)``;
* naive: each micro-batch's mean loss divided by k, summed in ``.grad`` (the usual recipe, which
  weights a token of a short micro-batch more than one of a long micro-batch).

Each prints its distance from the big batch and its time per update; the script exits with
status 1 if ours is not exact: max|Δw| ≤ 1e-5·max|w| in fp32. Under ``--bf16`` (autocast, fp32
weights) every split of the batch rounds its backward differently and Adam amplifies that noise,
so no run is exact; the script prints the distances and only checks a loose 5e-2·max|w| bound.

Usage: python examples/hf_gpt2.py [--updates 10] [--accum 4] [--batch 4] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import textwrap
import time

import torch
import transformers

from gradient_accumulator.torch import GradientAccumulateOptimizer


def corpus_lines(max_len: int) -> list[str]:
    lines = [ln.strip() for ln in inspect.getsource(textwrap).splitlines()]
    return [ln[:max_len] for ln in lines if len(ln) >= 4]


def encode(lines: list[str]) -> tuple[list[torch.Tensor], int]:
    chars = sorted({c for ln in lines for c in ln})
    index = {c: i + 1 for i, c in enumerate(chars)}  # 0 is padding
    return [torch.tensor([index[c] for c in ln]) for ln in lines], len(chars) + 1


def pad(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def target_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], vocab: int):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def make_model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def run(kind: str, cycles, vocab: int, clip: float, bf16: bool):
    model = make_model(vocab)
    opt = make_optimizer(model)
    warmup = max(1, len(cycles) // 4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if kind == "ours":
        acc = GradientAccumulateOptimizer(opt, len(cycles[0]), max_grad_norm=clip)
        sched = transformers.get_linear_schedule_with_warmup(acc, warmup, len(cycles))
    else:
        sched = transformers.get_linear_schedule_with_warmup(opt, warmup, len(cycles))
    start = time.perf_counter()
    for cycle in cycles:
        if kind == "big":
            tokens = sum(target_tokens(b) for b in cycle)
            with autocast:
                loss = sum(token_loss_sum(model, b, vocab) for b in cycle) / tokens
            loss.backward()
        for b in cycle if kind != "big" else ():
            n = target_tokens(b)
            with autocast:
                loss = token_loss_sum(model, b, vocab) / n  # this micro-batch's token mean
            if kind == "ours":
                loss.backward()
                acc.step(weight=n)
                acc.zero_grad()
            else:
                (loss / len(cycle)).backward()
        if kind == "ours":
            assert acc.update_applied
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        sched.step()
    return flat(model), (time.perf_counter() - start) / len(cycles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per update")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights)")
    args = parser.parse_args(argv)

    seqs, vocab = encode(corpus_lines(args.max_len))
    need = args.updates * args.accum * args.batch
    if need > len(seqs):
        parser.error(f"the corpus has {len(seqs)} lines, {need} are needed")
    micro = [pad(seqs[i : i + args.batch]) for i in range(0, need, args.batch)]
    cycles = [micro[i : i + args.accum] for i in range(0, len(micro), args.accum)]
    tokens = [sum(target_tokens(b) for b in c) for c in cycles]
    print(
        f"GPT-2 char-level on textwrap's source: vocab {vocab}, {args.updates} updates of "
        f"{args.accum} x {args.batch} lines, {min(tokens)}-{max(tokens)} target tokens a "
        f"cycle, {'bf16 autocast' if args.bf16 else 'fp32'}"
    )

    # Warm-up (thread pools, first-call allocations) so the first timed run is not charged for it.
    token_loss_sum(make_model(vocab), micro[0], vocab).backward()
    ref, t_big = run("big", cycles, vocab, args.clip, args.bf16)
    scale = ref.abs().max().item()
    tol = (5e-2 if args.bf16 else 1e-5) * scale
    results = {"big batch": (0.0, t_big)}
    for kind, label in (("ours", "ours (token weights)"), ("naive", "naive loss/k")):
        w, t = run(kind, cycles, vocab, args.clip, args.bf16)
        results[label] = ((w - ref).abs().max().item(), t)
    for label, (dist, t) in results.items():
        print(f"{label:>22}: max|dw| from the big batch {dist:.3e}   {1e3 * t:7.1f} ms/update")
    ours = results["ours (token weights)"][0]
    ok = ours <= tol
    print(
        f"ours is {'exact' if ok else 'NOT exact'} (tolerance {tol:.1e} = "
        f"{'5e-2' if args.bf16 else '1e-5'} x max|w| {scale:.3f})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
