"""The weight the DEL paper's runs applied, from their trainers' arithmetic (docs/DEL.md, "The
weight the paper's runs applied").

The authors' scripts add `a x` the micro-batch's mean DEL term to its cross-entropy. How much
that weighs on the step's mean term depends on their trainer:

- transformers 4.57.1 (`train-qwen-deepseek.py`, a = 0.01): CE is the micro-batch's CE sum over
  the step's token count (all GA micro-batches, all P processes); `compute_loss` multiplies the
  loss by P (`average_tokens_across_devices`); `training_step` does not divide by GA (the script
  sets `compute_loss_func`); gradients add over the GA micro-batches and average over P.
- transformers 4.35.2 (`train-codellama-mistral.py`, a = 0.1): CE is the micro-batch's mean;
  accelerate divides every micro-batch's loss by GA; gradients average over P.

Replayed here in plain torch, fp64, one sequence a micro-batch (the scripts' batch size 1), the
DEL gradient equals ours (the digit reduction over the whole step) at alpha = a x GA x P for
4.57.1 and alpha = a for 4.35.2 when every micro-batch holds the same number of digit targets.
When they do not, each micro-batch's digits weigh mean digits / its digits of ours.
"""

import pytest
import torch
import torch.nn.functional as F

import del_megatron as dm
from del_megatron.reference import reference_place_weights

VOCAB = dm.DigitVocab(range(10), [10])  # '0'..'9' ids 0..9, '.' 10, words 11..19
V, S = 20, 24


def micro_batch(digits: int, seed: int) -> torch.Tensor:
    """labels [1, S]: `digits` digit targets in numbers of up to 4 digits, words elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    labels = 11 + torch.randint(0, 9, (1, S), generator=gen)
    pos, left = 1, digits
    while left:
        n = min(left, 4)
        labels[0, pos : pos + n] = torch.randint(0, 10, (n,), generator=gen)
        pos, left = pos + n + 1, left - n
    return labels


def random_logits(n: int) -> torch.Tensor:
    """fp64 [n, S, V], the same every run."""
    return torch.randn(n, S, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def authors_del_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The scripts' DEL before `a x`: over the micro-batch's digit targets, BCE-with-logits of
    the ten raw digit logits against the one-hot target, times their softmax, times the place
    weight, averaged over the [N_d, 10] entries; 0 without a digit target. logits [S, V] fp64,
    labels [S]."""
    digit = labels < 10
    if not digit.any():
        return logits.sum() * 0.0
    z = logits[digit][:, :10]
    target = F.one_hot(labels[digit], 10).to(z.dtype)
    bce = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    place = reference_place_weights(labels[None], VOCAB)[0][digit]
    return (bce * torch.softmax(z, dim=-1) * place[:, None]).mean()


def authors_gradient(batches, logits, trainer: str, a: float, ga: int, procs: int):
    """(d(step objective)/d(logits), its DEL part) as the authors' trainer forms them:
    micro-batch k of process p is batches[p * ga + k]; logits [P x GA, S, V]."""
    n_tokens = sum(b.numel() for b in batches)  # num_items_in_batch: gathered over P
    total, of_del = torch.zeros_like(logits), torch.zeros_like(logits)
    for i, labels in enumerate(batches):
        x = logits[i].detach().requires_grad_()
        ce = F.cross_entropy(x, labels[0], reduction="sum")
        if trainer == "4.57.1":  # x P (average_tokens_across_devices), no division by GA
            ce, scale = ce / n_tokens, procs
        else:  # 4.35.2: the micro-batch's CE mean; accelerate divides by GA
            ce, scale = ce / labels.numel(), 1 / ga
        term = a * authors_del_mean(x, labels[0])
        g_ce, g_del = (torch.autograd.grad(scale * t, x, retain_graph=True)[0] for t in (ce, term))
        # each process sums its GA micro-batches; FSDP / DDP average over the P processes
        total[i], of_del[i] = (g_ce + g_del) / procs, g_del / procs
    return total, of_del


def our_gradient(batches, logits, alpha: float):
    """d/d(logits) of our step loss: mean CE + alpha x the mean term over the step's digit
    targets (the digit reduction, all micro-batches in one count)."""
    x = logits.detach().requires_grad_()
    cfg = dm.NumericalLossConfig(loss="del", alpha=alpha, vocab=VOCAB)
    labels = torch.cat(batches)  # [P x GA, S]
    loss = dm.numerical_lm_loss(labels, x.transpose(0, 1), cfg).mean()
    (g,) = torch.autograd.grad(loss, x)
    return g


RUNS = [  # (trainer, the weight the script wrote, GA, P, the weight it applied)
    ("4.57.1", 0.01, 32, 4, 1.28),  # Qwen2.5 (train_qwen.sh: 4 GPUs)
    ("4.57.1", 0.01, 32, 8, 2.56),  # DeepSeek-Math (train_deepseek.sh: 8 GPUs)
    ("4.35.2", 0.1, 32, 4, 0.1),  # CodeLlama (train_codellama.sh: 4 GPUs)
]


@pytest.mark.parametrize("trainer, a, ga, procs, applied", RUNS)
def test_equal_digit_counts_apply_a_x_ga_x_p_under_4_57_and_a_under_4_35(
    trainer, a, ga, procs, applied
):
    assert applied == pytest.approx(a * ga * procs if trainer == "4.57.1" else a)
    batches = [micro_batch(6, seed) for seed in range(ga * procs)]
    logits = random_logits(len(batches))
    theirs, their_del = authors_gradient(batches, logits, trainer, a, ga, procs)
    ours = our_gradient(batches, logits, applied)
    # The whole gradient agrees (CE included: equal lengths, so 4.35.2's mean of means is the
    # token mean), and the DEL part is not small beside it.
    torch.testing.assert_close(theirs, ours, rtol=1e-10, atol=1e-14)
    assert their_del.norm() > 0.05 * theirs.norm()
    # The weight as written is 1/(GA x P) of it under 4.57.1.
    if trainer == "4.57.1":
        written = our_gradient(batches, logits, a) - our_gradient(batches, logits, 0.0)
        torch.testing.assert_close(their_del, written * ga * procs, rtol=1e-10, atol=1e-14)


def test_unequal_digit_counts_weigh_each_micro_batch_by_mean_digits_over_its_own():
    """GA 4, P 2, digit targets 2, 4, ..., 16 (mean 9): the authors' DEL gradient on micro-batch
    k is ours at alpha = 0.01 x GA x P times 9 / N_d(k): 4.5x ours on the 2-digit one, 0.5625x
    on the 16-digit one."""
    ga, procs = 4, 2
    counts = [2, 4, 6, 8, 10, 12, 14, 16]
    batches = [micro_batch(n, seed) for seed, n in enumerate(counts)]
    logits = random_logits(len(batches))
    _, theirs = authors_gradient(batches, logits, "4.57.1", 0.01, ga, procs)
    ours = our_gradient(batches, logits, 0.01 * ga * procs) - our_gradient(batches, logits, 0.0)
    mean = sum(counts) / len(counts)
    for k, n in enumerate(counts):
        torch.testing.assert_close(theirs[k], ours[k] * mean / n, rtol=1e-10, atol=1e-14)
    print(f"relative difference of the DEL gradient: {(theirs - ours).norm() / ours.norm():.3f}")
