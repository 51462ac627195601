"""Bodies of the chunking-vocabulary tests on gloo groups (tests/test_chunked_digits.py): every
loss, kernel and dtype, materialised and logits-free (both weight-gradient routes), against the
fp64 oracle of docs/DEL.md at any tensor-parallel size, under both slot rules ("length" and
"any"). Each check takes (seed, kernel)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron.digits.slots import RULES
from del_megatron.loss import LOSSES
from del_megatron.reference import reference_lm_loss

from .cases import TOKEN_FORM, token_share

# 1,200 ids (divisible by 1, 2, 4): the 1,110 number tokens, two decimal points and 88 others,
# at shuffled ids, so that every shard holds some of every kind.
VOCAB_SIZE = 1200
IGNORE = -100
_ORDER = torch.randperm(VOCAB_SIZE, generator=torch.Generator().manual_seed(5)).tolist()
VOCAB = dm.DigitVocab(_ORDER[:10], _ORDER[1110:1112], _ORDER[10:1110])
_OTHERS = _ORDER[1112:]
ALPHA = 0.7


def labels_for(batch: int, seq: int, seed: int) -> torch.Tensor:
    """int64 [batch, seq]: numbers of one to three tokens of every length, decimal points, other
    tokens and ignored positions."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.rand(batch, seq, generator=gen)
    numbers = torch.tensor(_ORDER[:1110])[torch.randint(0, 1110, (batch, seq), generator=gen)]
    singles = torch.tensor(_ORDER[:10])[torch.randint(0, 10, (batch, seq), generator=gen)]
    points = torch.tensor(_ORDER[1110:1112])[torch.randint(0, 2, (batch, seq), generator=gen)]
    others = torch.tensor(_OTHERS)[torch.randint(0, len(_OTHERS), (batch, seq), generator=gen)]
    labels = torch.where(pick < 0.45, numbers, others)
    labels = torch.where((pick >= 0.45) & (pick < 0.6), singles, labels)
    labels = torch.where((pick >= 0.6) & (pick < 0.7), points, labels)
    return torch.where(pick > 0.94, torch.full_like(labels, IGNORE), labels)


def inputs(seed: int, seq: int = 13, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(seq, batch, VOCAB_SIZE, generator=gen, dtype=torch.float64)
    upstream = torch.rand(batch, seq, generator=gen, dtype=torch.float64) + 0.5
    return labels_for(batch, seq, seed), logits, upstream


def reference(labels, logits, loss, upstream, rule="any"):
    """Oracle per-token loss [b, s] and its gradient with respect to the whole-vocab logits."""
    leaf = logits.detach().to(torch.float64).requires_grad_(True)
    ce, term = reference_lm_loss(
        labels, leaf, VOCAB, loss=loss, alpha=ALPHA, ignore_index=IGNORE, slot_rule=rule
    )
    total = ce + ALPHA * term
    (grad,) = torch.autograd.grad((total * upstream).sum(), leaf)
    return ce.detach(), term.detach(), total.detach(), grad


def _group():
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def _shard(full: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return full.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _config(loss: str, reduction: str = "token", rule: str = "any") -> dm.NumericalLossConfig:
    return dm.NumericalLossConfig(
        loss=loss,
        alpha=ALPHA,
        vocab=VOCAB,
        reduction=reduction,
        digit_share=token_share(reduction),
        ignore_index=IGNORE,
        slot_logits=rule,
    )


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().double().clamp(min=1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def check_materialised(seed: int, kernel: str) -> dict:
    """Every loss and slot rule, fp32 and bf16 logits: values and gradients of this rank's shard
    equal the oracle's (bf16: of the rounded logits, the gradient to bf16 rounding). Returns the
    largest relative errors seen, by dtype, rule and quantity."""
    labels, logits, upstream = inputs(seed)
    worst = {}
    for dtype, value_tol, grad_tol in ((torch.float32, 2e-6, 1e-5), (torch.bfloat16, 2e-6, 8e-3)):
        rounded = logits.to(dtype)
        for loss, rule in [(loss, rule) for loss in LOSSES for rule in RULES]:
            if loss == "ce" and rule != RULES[0]:
                continue  # no slot logits in its loss
            ref = reference(labels, rounded, loss, upstream, rule)
            ref_ce, ref_term, ref_total, ref_grad = ref
            shard = _shard(rounded).detach().clone().requires_grad_(True)
            how = dict(layout=dm.VocabParallelLayout(tp_group=_group()), kernel=kernel)
            cfg = _config(loss, rule=rule)
            parts = dm.loss_parts(labels, shard, cfg, **how)
            total = dm.numerical_lm_loss(labels, shard, cfg, **how)
            (total * upstream.to(total.dtype)).sum().backward()
            errors = {
                "ce": _relative(parts.ce, ref_ce),
                "term": _relative(parts.term, ref_term),
                "total": _relative(total, ref_total),
                "grad": _relative(shard.grad, _shard(ref_grad)),
            }
            for what, error in errors.items():
                tol = grad_tol if what == "grad" else value_tol
                assert error <= tol, (loss, rule, dtype, what, error)
                key = f"{dtype}".removeprefix("torch.") + f" {rule} {what}"
                worst[key] = max(worst.get(key, 0.0), error)
            assert parts.digit_logits.shape == (*labels.shape, 3, 10)
    return worst


def check_digit_reduction_counts_digits(seed: int, kernel: str) -> None:
    """The "digit" reduction divides the summed term by the digits (not tokens) of the whole
    batch: the mean over loss tokens is mean CE + alpha * sum(term) / n_digits."""
    labels, logits, upstream = inputs(seed)
    ref_ce, ref_term, _, _ = reference(labels, logits, "del", upstream)
    shard = _shard(logits).float()
    loss = dm.numerical_lm_loss(
        labels, shard, _config("del", "digit"), dm.VocabParallelLayout(tp_group=_group())
    )
    parts = dm.loss_parts(labels, shard, _config("del"), dm.VocabParallelLayout(tp_group=_group()))
    valid = labels != IGNORE
    n_digits = parts.digit_count.sum()
    assert n_digits > parts.is_digit.sum()  # some labels hold two or three digits
    expected = ref_ce[valid].mean() + ALPHA * ref_term.sum() / n_digits.double()
    torch.testing.assert_close(loss[valid].double().mean(), expected, rtol=2e-6, atol=0)


def check_collectives_carry_slot_sums(seed: int, kernel: str) -> None:
    """docs/DEL.md, tensor parallelism: each rank sends partial sums of its own number tokens,
    not their logits. The forward pass makes two all-reduces: MAX of the N row maxima, 20 slot
    group maxima a row and the two shard sizes; SUM of [N, 2 + 30] (a one-digit vocab: N + 2
    and [N, 12]), whatever the vocab shard holds."""
    labels, logits, _ = inputs(seed)
    n = labels.numel()
    shard = _shard(logits).float().requires_grad_(True)
    sent = []
    all_reduce = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, **kwargs):
        sent.append((str(op).split(".")[-1], tuple(tensor.shape)))
        return all_reduce(tensor, op=op, **kwargs)

    one_digit = dm.NumericalLossConfig(
        loss="del", alpha=ALPHA, vocab=VOCAB.single_digits_only(), **TOKEN_FORM
    )
    dist.all_reduce = recording
    try:
        for cfg, maxima, sums in (
            (_config("del", rule="any"), n * 21 + 2, (n, 32)),
            (_config("del", rule="length"), n * 21 + 2, (n, 32)),
            (one_digit, n + 2, (n, 12)),
        ):
            sent.clear()
            loss = dm.numerical_lm_loss(
                labels, shard, cfg, dm.VocabParallelLayout(tp_group=_group()), kernel=kernel
            )
            assert sent == [("MAX", (maxima,)), ("SUM", sums)], sent
            sent.clear()
            loss.sum().backward()
            assert sent == [], sent  # backward communicates nothing
    finally:
        dist.all_reduce = all_reduce


def check_logits_free(seed: int, route: str) -> dict:
    """numerical_linear_loss on this rank's weight shard, fp32 and bf16, with and without a loss
    mask, against the oracle on hidden @ weight.T: values and the gradients of hidden and of
    the whole weight."""
    gen = torch.Generator().manual_seed(seed)
    seq, batch, hidden_size = 11, 2, 8
    labels = labels_for(batch, seq, seed)
    hidden = torch.randn(seq, batch, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB_SIZE, hidden_size, generator=gen, dtype=torch.float64)
    upstream = (labels != IGNORE).double()  # Megatron's loss mask: proportional, as required
    worst = {}
    for dtype, value_tol, grad_tol in ((torch.float32, 2e-6, 2e-5), (torch.bfloat16, 1e-5, 3e-2)):
        h, w = hidden.to(dtype), weight.to(dtype)
        for loss, rule in (("del", "length"), ("del", "any"), ("ntl_was", "length")):
            # The oracle on the logits as the output layer forms them (in the input dtype),
            # its gradients taken to hidden and weight in fp64.
            leaf = torch.matmul(h, w.t()).double().requires_grad_(True)
            ce, term = reference_lm_loss(
                labels, leaf, VOCAB, loss=loss, ignore_index=IGNORE, slot_rule=rule
            )
            ref_total = ce + ALPHA * term
            (grad,) = torch.autograd.grad((ref_total * upstream).sum(), leaf)
            ref_gh = torch.matmul(grad, w.double())
            ref_gw = torch.einsum("sbv,sbh->vh", grad, h.double())
            for loss_mask in (None, upstream.float()):
                ours_h = h.clone().requires_grad_(True)
                ours_w = _shard(w, 0).clone().requires_grad_(True)
                total = dm.numerical_linear_loss(
                    ours_h,
                    ours_w,
                    labels,
                    _config(loss, rule=rule),
                    dm.VocabParallelLayout(tp_group=_group()),
                    loss_mask=loss_mask,
                    weight_gradient=route,
                    chunk_tokens=5,
                )
                (total * upstream.to(total.dtype)).sum().backward()
                pieces = [torch.empty_like(ours_w.grad) for _ in range(dist.get_world_size())]
                dist.all_gather(pieces, ours_w.grad)
                errors = {
                    "total": _relative(total, ref_total.detach()),
                    "grad hidden": _relative(ours_h.grad, ref_gh),
                    "grad weight": _relative(torch.cat(pieces), ref_gw),
                }
                for what, error in errors.items():
                    tol = value_tol if what == "total" else grad_tol
                    assert error <= tol, (loss, rule, dtype, loss_mask is None, what, error)
                    key = f"{dtype}".removeprefix("torch.") + f" {rule} {what}"
                    worst[key] = max(worst.get(key, 0.0), error)
    return worst


def long_numbers(total: int, seed: int) -> torch.Tensor:
    """int64 [1, total]: numbers of 4..11 digits cut as a chunking tokenizer cuts them (left to
    right in threes), some with a decimal point, between other tokens: chunk and document
    borders fall inside numbers."""
    gen = torch.Generator().manual_seed(seed)
    ids = {text: i for i, text in VOCAB.number_tokens()}
    row = []
    while len(row) < total:
        length = int(torch.randint(4, 12, (1,), generator=gen))
        digits = "".join(str(int(d)) for d in torch.randint(0, 10, (length,), generator=gen))
        parts = [digits]
        if torch.rand(1, generator=gen) < 0.5:
            cut = int(torch.randint(1, len(digits), (1,), generator=gen))
            parts = [digits[:cut], digits[cut:]]
        for n, part in enumerate(parts):
            if n:
                row.append(VOCAB.decimal_point_ids[0])
            row += [ids[part[i : i + 3]] for i in range(0, len(part), 3)]
        row += [_OTHERS[0]] * int(torch.randint(1, 3, (1,), generator=gen))
    labels = torch.tensor([row[:total]])
    labels[0, -2] = IGNORE
    return labels


def check_cp_and_packing(seed: int, kernel: str) -> None:
    """CP over the whole group, THD: three packed documents, each cut into 2 * cp chunks
    (Megatron's layout): per-token losses and this rank's logit gradients equal the oracle's on
    each document alone."""
    from del_megatron.sequence import cp_positions

    cp, rank = dist.get_world_size(), dist.get_rank()
    lengths = [2 * cp * k for k in (4, 2, 3)]
    docs = [long_numbers(n, seed + i) for i, n in enumerate(lengths)]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    packed = torch.cat(docs, dim=1)
    total = packed.size(1)
    positions = cp_positions(total // cp, cp, rank, cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    full = 3 * torch.randn(total, 1, VOCAB_SIZE, generator=gen, dtype=torch.float64)
    upstream = torch.rand(1, total, generator=gen, dtype=torch.float64) + 0.5
    for loss, rule in (("del", "length"), ("del", "any"), ("dist2", "length")):
        ref_total, ref_grad, start = [], [], 0
        for doc in docs:
            end = start + doc.size(1)
            _, _, total_doc, grad_doc = reference(
                doc, full[start:end], loss, upstream[:, start:end], rule
            )
            ref_total.append(total_doc)
            ref_grad.append(grad_doc)
            start = end
        ref_total, ref_grad = torch.cat(ref_total, dim=1), torch.cat(ref_grad, dim=0)
        logits = full[positions].float().requires_grad_(True)
        ours = dm.numerical_lm_loss(
            packed[:, positions],
            logits,
            _config(loss, rule=rule),
            dm.VocabParallelLayout(cp_group=dist.group.WORLD, cu_seqlens=cu_seqlens),
            kernel=kernel,
        )
        (ours * upstream[:, positions].float()).sum().backward()
        assert _relative(ours, ref_total[:, positions]) < 2e-6, (loss, rule)
        assert _relative(logits.grad, ref_grad[positions]) < 1e-5, (loss, rule)
