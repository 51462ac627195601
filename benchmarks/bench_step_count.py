"""What the "digit" reduction's step count costs beside the loss, on one rank.

    .venv/bin/python benchmarks/bench_step_count.py --microbatches 8 32 --seq 4096 --vocab 32000

DigitAccounting.count looks at every micro-batch of a step before the step's first forward:
one number_layout over each micro-batch's labels and one all-reduce of two numbers (none here:
one rank). This times that count for a step of M micro-batches of [1, seq] labels with a digit
share like the demo's (0.3) and sets it against the loss the same step computes,
numerical_lm_loss forward + backward on each micro-batch's [seq, 1, vocab] bf16 logits (M times
the median of one), in the same run. The look-ahead holds the step's batches at once:
`held_mib` is what Megatron-LM's get_batch gives per micro-batch (tokens, labels, loss_mask,
position_ids; attention_mask None) times M, against one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import del_megatron as dm  # noqa: E402
from del_megatron.megatron.accounting import DigitAccounting  # noqa: E402


def labels_like_text(seq: int, vocab: dm.DigitVocab, share: float, seed: int) -> torch.Tensor:
    """[1, seq] ids: numbers of 1-4 digits between word ids, about `share` of them digits."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(100, 30000, (1, seq), generator=g)
    digits = torch.tensor(vocab.digit_ids)[torch.randint(0, 10, (1, seq), generator=g)]
    return torch.where(torch.rand(1, seq, generator=g) < share, digits, words)


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(microbatches: int, seq: int, vocab_size: int, reps: int) -> dict:
    vocab = dm.DigitVocab(range(48, 58), [46])
    batches = [
        {"labels": labels_like_text(seq, vocab, 0.3, seed), "loss_mask": torch.ones(1, seq)}
        for seed in range(microbatches)
    ]
    accounting = DigitAccounting(vocab, microbatches)
    count_s = median_seconds(lambda: accounting.count(batches), reps)
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=vocab)
    logits = torch.randn(seq, 1, vocab_size, dtype=torch.bfloat16, requires_grad=True)

    def one_loss():
        dm.numerical_lm_loss(batches[0]["labels"], logits, cfg).sum().backward()
        logits.grad = None

    loss_s = median_seconds(one_loss, reps) * microbatches
    per_batch = 4 * seq * 8  # tokens, labels, position_ids (int64) and loss_mask (fp32 as 8)
    return {
        "microbatches": microbatches,
        "seq": seq,
        "vocab": vocab_size,
        "count_s": count_s,
        "loss_s": loss_s,
        "count_vs_loss": count_s / loss_s,
        "held_mib": microbatches * per_batch / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [case(m, args.seq, args.vocab, args.reps) for m in args.microbatches]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
