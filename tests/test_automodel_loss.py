"""The NeMo AutoModel loss (del_megatron/automodel/loss.py) as AutoModel calls it: against the
fp64 reference, against MaskedCrossEntropy's arithmetic at alpha 0, in the papers' unit under
gradient accumulation and data parallel, and on DTensor logits sharded on the vocabulary."""

import pytest
import torch
import torch.nn.functional as F

from del_megatron.automodel.loss import NumericalLoss
from del_megatron.reference import reference_lm_loss

from . import automodel_workers as workers

IDS = dict(digit_ids=range(3, 13), decimal_point_ids=[13])


@pytest.mark.parametrize("loss", ["del", "digit_ce"])
def test_the_loss_is_the_reference_sum_over_the_steps_tokens(loss):
    """Training: (sum CE + alpha x N / D x sum term) / N, where N and D are the step's loss
    tokens and digit targets; validation (num_label_tokens None): the batch's raw sum."""
    labels, logits = workers.batch(1)
    fn = NumericalLoss(numerical_loss=loss, alpha=0.3, **IDS)
    ce, term = reference_lm_loss(labels, logits.transpose(0, 1), workers.VOCAB, loss, 0.3)
    step_digits, step_tokens = 17.0, 61
    fn.begin_step(torch.tensor(step_digits, dtype=torch.float64))
    got = fn(logits=logits, labels=labels, num_label_tokens=step_tokens)
    expected = ce.sum() / step_tokens + 0.3 * term.sum() / step_digits
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    with torch.no_grad():
        raw = fn(logits=logits, labels=labels, num_label_tokens=None)
    tokens, digits = (labels != -100).sum(), fn.count_digit_targets([labels])
    assert float(raw) == pytest.approx(
        float(ce.sum() + 0.3 * tokens / digits * term.sum()), rel=1e-6
    )


def test_alpha_0_is_masked_cross_entropy():
    """AutoModel's MaskedCrossEntropy: fp32 F.cross_entropy summed, divided by num_label_tokens."""
    labels, logits = workers.batch(2)
    fn = NumericalLoss(alpha=0.0, **IDS)
    fn.begin_step(fn.count_digit_targets([labels]))
    got = fn(logits=logits, labels=labels, num_label_tokens=50)
    masked = F.cross_entropy(logits.view(-1, workers.V), labels.view(-1), reduction="sum") / 50
    assert float(got) == pytest.approx(float(masked), rel=1e-6)


def test_under_accumulation_and_data_parallel_the_weight_on_the_mean_term_is_alpha():
    """GA 4 x DP 2: eight micro-batches, each rank's four summed and the two ranks' sums added
    (FSDP's mean over DP times the recipe's dp factor). The step's loss has weight alpha on the
    term's mean over all its digit targets; a per-micro-batch mean would make it GA x DP
    times the term's share instead."""
    alpha, batches = 0.25, [workers.batch(10 + i, b=1) for i in range(8)]
    fn = NumericalLoss(alpha=alpha, **IDS)
    n_tokens = sum(int((labels != -100).sum()) for labels, _ in batches)
    fn.begin_step(fn.count_digit_targets(labels for labels, _ in batches))  # the recipe's count
    step = sum(
        fn(logits=logits, labels=labels, num_label_tokens=n_tokens) for labels, logits in batches
    )
    ce = term = digits = 0.0
    for labels, logits in batches:
        c, t = reference_lm_loss(labels, logits.transpose(0, 1), workers.VOCAB, "del", alpha)
        ce, term = ce + float(c.sum()), term + float(t.sum())
    digits = float(fn.count_digit_targets(labels for labels, _ in batches))
    assert float(step) == pytest.approx(ce / n_tokens + alpha * term / digits, rel=1e-6)
    weight = (float(step) - ce / n_tokens) / (term / digits)
    assert weight == pytest.approx(alpha, rel=1e-5)
    per_microbatch = 0.0  # the per-micro-batch mean: alpha x each batch's term mean, summed
    for labels, logits in batches:
        c, t = reference_lm_loss(labels, logits.transpose(0, 1), workers.VOCAB, "del", alpha)
        per_microbatch += alpha * float(t.sum()) / float(fn.count_digit_targets([labels]))
    assert per_microbatch / (term / digits) > 6 * alpha  # about GA x DP = 8 times too heavy


def test_a_digit_step_without_its_count_is_refused():
    labels, logits = workers.batch(4)
    with pytest.raises(RuntimeError, match="NumericalLossRecipe"):
        NumericalLoss(**IDS)(logits=logits, labels=labels, num_label_tokens=10)
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        NumericalLoss(alpha=-1.0, **IDS)
    with pytest.raises(ValueError, match="loss_weights"):
        NumericalLoss(reduction="token", digit_share=0.5, **IDS)(
            logits=logits, labels=labels, num_label_tokens=9, loss_weights=torch.ones(2, 24)
        )


@pytest.mark.parametrize(
    "loss, reduction",
    [("del", "digit"), ("ntl_was", "token"), ("ce", "digit"), ("digit_ce", "digit")],
)
def test_tensor_parallel_equals_whole_vocabulary(gloo, loss, reduction):
    gloo(2).run(workers.sharded_equals_whole, loss, reduction)


def test_a_dtensor_not_sharded_on_the_vocabulary_is_refused(gloo):
    gloo(2).run(workers.other_placements_are_refused)


def test_plain_logits_narrower_than_the_vocabulary_are_refused():
    """A vocab shard handed over as a plain tensor (a plan with use_local_output=True) would be
    taken for the whole vocabulary: refused by its width against the model's vocabulary."""
    labels, logits = workers.batch(5)
    fn = NumericalLoss(reduction="token", digit_share=0.5, **IDS)
    fn.vocab_size = 2 * workers.V
    with pytest.raises(ValueError, match="plain tensor of 32 columns where the model's vocab"):
        fn(logits=logits, labels=labels, num_label_tokens=9)


def test_a_chunking_tokenizer_gives_single_digits_by_default_and_slots_on_request():
    from .test_tokenizers import LLAMA3_TOKENIZER

    single = NumericalLoss(tokenizer=str(LLAMA3_TOKENIZER)).cfg.vocab
    slots = NumericalLoss(tokenizer=str(LLAMA3_TOKENIZER), slot_logits="length").cfg
    assert not single.chunked and len(slots.vocab.multi_digit_ids) == 1100
    assert slots.slot_logits == "length" and slots.vocab.digit_ids == single.digit_ids


def test_the_control_arm_reports_the_digit_entries_without_a_term():
    labels, logits = workers.batch(6)
    fn = NumericalLoss(numerical_loss="ce", **IDS)
    fn.begin_step(fn.count_digit_targets([labels]))
    loss = fn(logits=logits, labels=labels, num_label_tokens=42)
    masked = F.cross_entropy(logits.view(-1, workers.V), labels.view(-1), reduction="sum") / 42
    assert float(loss) == pytest.approx(float(masked), rel=1e-6)
    entries = fn.entries(fn.step_sums())
    assert "ce term" not in entries and {"ce loss", "digit acc", "digit tokens"} <= set(entries)
    assert entries["digit tokens"] == float(fn.count_digit_targets([labels]))
