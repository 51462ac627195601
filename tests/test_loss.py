"""numerical_lm_loss on one device: hand-computed values, gradcheck, reductions, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

import del_megatron as dm
from del_megatron.kernels import resolve_kernel
from del_megatron.loss import LOSSES
from del_megatron.reference import reference_lm_loss

from .cases import IGNORE, SPLIT_VOCAB, logits_for, number_rich_labels

VOCAB = dm.DigitVocab(digit_ids=range(10), decimal_point_ids=[10])  # ids 0..9 are the digits
V = 16


def one_token(digit_logits, target, vocab_size=V):
    """logits [1, 1, V] with the given ten digit logits (others -30), labels [1, 1]."""
    logits = torch.full((1, 1, vocab_size), -30.0, dtype=torch.float64)
    logits[0, 0, :10] = torch.tensor(digit_logits, dtype=torch.float64)
    return torch.tensor([[target]]), logits


def test_hand_computed_del_value():
    # z = (2, 0, ..., 0), target digit 0, a lone units digit (w = 2):
    # p0 = e^2 / (e^2 + 9), p_k = 1 / (e^2 + 9); -log s(2) = log(1 + e^-2); -log(1 - s(0)) = log 2
    # l = (1/10) (p0 log(1 + e^-2) + 9 p_k log 2) = 0.0437866, term = 2 l
    p0 = math.exp(2) / (math.exp(2) + 9)
    pk = 1 / (math.exp(2) + 9)
    l_t = (p0 * math.log1p(math.exp(-2)) + 9 * pk * math.log(2)) / 10
    assert l_t == pytest.approx(0.04378655, abs=1e-8)
    labels, logits = one_token([2.0] + [0.0] * 9, 0)
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=VOCAB)
    parts = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
    assert parts.term.item() == pytest.approx(2 * l_t, rel=1e-12)
    ce = -F.log_softmax(logits[0, 0], dim=-1)[0].item()
    total = dm.numerical_lm_loss(labels, logits, cfg)
    assert total.item() == pytest.approx(ce + 0.1 * 2 * l_t, rel=1e-12)


def test_hand_computed_uniform_digits():
    # All ten digit logits 0: p = 0.1, every BCE = log 2, so l = log(2) / 10; tens place w = 4.
    labels = torch.tensor([[3, 7]])
    logits = torch.zeros(2, 1, V, dtype=torch.float64)
    cfg = dm.NumericalLossConfig(loss="del", vocab=VOCAB)
    term = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True).term
    assert term[0].tolist() == pytest.approx([4 * math.log(2) / 10, 2 * math.log(2) / 10])


def test_hand_computed_peer_heads():
    labels, logits = one_token([0.0] * 10, 3)
    parts = {
        loss: dm.numerical_lm_loss(
            labels, logits, dm.NumericalLossConfig(loss=loss, vocab=VOCAB), return_parts=True
        ).term.item()
        for loss in ("ntl_was", "ntl_mse")
    }
    # uniform p: E|k - 3| = (3+2+1+0+1+2+3+4+5+6)/10 = 2.7; (E k - 3)^2 = (4.5 - 3)^2 = 2.25
    assert parts["ntl_was"] == pytest.approx(2.7)
    assert parts["ntl_mse"] == pytest.approx(2.25)


@pytest.mark.parametrize("loss", LOSSES)
def test_gradcheck_float64(loss):
    # 2 x 7 positions: 6 digit targets in runs, 2 decimal points, 2 ignored
    labels = number_rich_labels(2, 7, seed=5)
    logits = logits_for(7, 2, 64, seed=5).requires_grad_(True)
    cfg = dm.NumericalLossConfig(loss=loss, alpha=0.9, vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    assert torch.autograd.gradcheck(lambda x: dm.numerical_lm_loss(labels, x, cfg), (logits,))
    digit_cfg = dm.NumericalLossConfig(
        loss=loss, alpha=0.9, vocab=SPLIT_VOCAB, ignore_index=IGNORE, reduction="digit"
    )
    assert torch.autograd.gradcheck(lambda x: dm.numerical_lm_loss(labels, x, digit_cfg), (logits,))


def test_digit_reduction_is_the_spec_formula():
    labels = number_rich_labels(3, 21, seed=5)
    logits = logits_for(21, 3, 64, seed=5)
    alpha = 0.3
    ce, term = reference_lm_loss(labels, logits, SPLIT_VOCAB, loss="del", ignore_index=IGNORE)
    valid = labels != IGNORE
    is_digit = torch.isin(labels, torch.tensor(SPLIT_VOCAB.digit_ids))
    spec = ce[valid].mean() + alpha * term[is_digit].sum() / is_digit.sum()
    cfg = dm.NumericalLossConfig(
        loss="del", alpha=alpha, vocab=SPLIT_VOCAB, reduction="digit", ignore_index=IGNORE
    )
    per_token = dm.numerical_lm_loss(labels, logits, cfg)
    assert per_token[valid].mean().item() == pytest.approx(spec.item(), rel=1e-12)
    parts = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
    m = valid.double()
    composed = (parts.ce * m).sum() / m.sum() + alpha * (parts.term * m).sum() / (
        parts.is_digit * m
    ).sum()
    assert composed.item() == pytest.approx(spec.item(), rel=1e-12)


def test_reference_compat_switch_changes_the_loss_only_across_ignored_spans():
    labels = torch.tensor([[1, 2, IGNORE, 3, 4]])
    logits = logits_for(5, 1, V, seed=1)
    fixed = reference_lm_loss(labels, logits, VOCAB, ignore_index=IGNORE)[1]
    joined = reference_lm_loss(
        labels, logits, VOCAB, ignore_index=IGNORE, join_across_ignored=True
    )[1]
    ours = dm.numerical_lm_loss(
        labels, logits, dm.NumericalLossConfig(vocab=VOCAB), return_parts=True
    ).term
    torch.testing.assert_close(ours, fixed)
    # joined, "1" is the thousands digit of 1234 (w = 8) instead of the tens of 12 (w = 4)
    assert (joined[0, 0] / fixed[0, 0]).item() == pytest.approx(2.0)


def test_ignored_positions_have_zero_loss_and_zero_grad():
    labels = torch.tensor([[IGNORE, 4, IGNORE], [IGNORE, IGNORE, IGNORE]])
    logits = logits_for(3, 2, V, seed=2).float().requires_grad_(True)
    loss = dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(vocab=VOCAB))
    loss.sum().backward()
    ignored = labels == IGNORE
    assert torch.all(loss[ignored] == 0) and torch.all(loss[~ignored] > 0)
    assert torch.all(logits.grad.transpose(0, 1)[ignored] == 0)


def test_non_finite_logits_are_reported_not_hidden():
    labels = torch.tensor([[4, 12]])
    logits = logits_for(2, 1, V, seed=2).float()
    logits[1, 0, 5] = float("nan")
    loss = dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(vocab=VOCAB))
    assert torch.isfinite(loss[0, 0]) and torch.isnan(loss[0, 1])


def test_caller_logits_untouched_for_every_dtype():
    labels = torch.tensor([[4, 12, 3]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        logits = logits_for(3, 1, V, seed=4).to(dtype).requires_grad_(True)
        before = logits.detach().clone()
        dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(vocab=VOCAB)).sum().backward()
        assert torch.equal(logits.detach(), before), dtype
        assert logits.grad.dtype == dtype


def test_output_dtype_and_shape():
    labels = torch.tensor([[4, 12, 3]])
    for dtype, out in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        loss = dm.numerical_lm_loss(
            labels, logits_for(3, 1, V, seed=4).to(dtype), dm.NumericalLossConfig(vocab=VOCAB)
        )
        assert loss.shape == (1, 3) and loss.dtype == out


# ---- bad input -------------------------------------------------------------------------------


def call(labels, logits, **cfg):
    return dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(vocab=VOCAB, **cfg))


@pytest.mark.parametrize(
    "labels,logits,error,match",
    [
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2 * V), ValueError, r"\[seq, batch"),
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, V), ValueError, r"\[batch, seq\]"),
        (torch.zeros(3, dtype=torch.long), torch.zeros(3, 1, V), ValueError, r"\[batch, seq\]"),
        (
            torch.zeros(1, 3, dtype=torch.long),
            torch.zeros(3, 1, V, dtype=torch.long),
            TypeError,
            "floating point",
        ),
        (torch.zeros(1, 3), torch.zeros(3, 1, V), TypeError, "integer tensor"),
        (torch.full((1, 3), V), torch.zeros(3, 1, V), ValueError, "outside the vocabulary of 16"),
        (torch.full((1, 3), -5), torch.zeros(3, 1, V), ValueError, "outside the vocabulary"),
        (
            torch.zeros(1, 3, dtype=torch.long),
            torch.zeros(3, 1, 8),
            ValueError,
            r"DigitVocab ids \[8, 9, 10\] lie outside",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(labels, logits, error, match):
    with pytest.raises(error, match=match):
        call(labels, logits)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(digit_ids=range(9)), ValueError, "exactly 10 ids"),
        (dict(digit_ids=[0] * 10), ValueError, "distinct"),
        (dict(digit_ids=range(-1, 9)), ValueError, "non-negative"),
        (dict(digit_ids=range(10), decimal_point_ids=[3]), ValueError, "both as digits"),
        (dict(digit_ids=range(10), decimal_point_ids=[11, 11]), ValueError, "distinct"),
        (dict(digit_ids=[0.5] * 10), TypeError, "integer token ids"),
        (dict(digit_ids=[True] * 10), TypeError, "integer token ids"),
    ],
)
def test_digit_vocab_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        dm.DigitVocab(**kwargs)


def test_digit_vocab_accepts_tensor_and_numpy_ids():
    import numpy as np

    assert dm.DigitVocab(torch.arange(10)).digit_ids == tuple(range(10))
    assert dm.DigitVocab(np.arange(5, 15), [np.int64(1)]).decimal_point_ids == (1,)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(loss="mse"), ValueError, "loss must be one of"),
        (dict(reduction="mean"), ValueError, "reduction must be one of"),
        (dict(loss="del", vocab=None), ValueError, "needs vocab"),
        (dict(vocab=list(range(10))), TypeError, "DigitVocab"),
        (dict(alpha="0.1"), TypeError, "alpha"),
    ],
)
def test_config_validation(kwargs, error, match):
    base = dict(vocab=VOCAB)
    base.update(kwargs)
    with pytest.raises(error, match=match):
        dm.NumericalLossConfig(**base)


def test_ce_needs_no_vocab():
    labels = torch.tensor([[1, 2]])
    logits = logits_for(2, 1, V, seed=0)
    loss = dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(loss="ce"))
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    )


def test_outputs_are_contiguous_like_megatrons():
    # Megatron-LM's and Megatron-Bridge's loss functions call output_tensor.view(-1).
    labels = torch.tensor([[4, 12, 3], [1, 2, 3]])
    logits = logits_for(3, 2, V, seed=4)
    for loss in ("ce", "del"):
        cfg = dm.NumericalLossConfig(loss=loss, vocab=VOCAB, reduction="token", digit_share=0.5)
        assert dm.numerical_lm_loss(labels, logits, cfg).is_contiguous()
        parts = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
        assert all(t.is_contiguous() for t in parts)
        torch.testing.assert_close(
            parts.token_loss(cfg.token_weight), dm.numerical_lm_loss(labels, logits, cfg)
        )


class _FakeCudaLogits:
    """Stands for a CUDA tensor in kernel selection (no GPU here)."""

    def __init__(self, dtype):
        self.device, self.dtype = torch.device("cuda", 0), dtype


@pytest.mark.parametrize(
    "logits, inplace, expected",
    [
        (_FakeCudaLogits(torch.bfloat16), False, "compiled"),
        (_FakeCudaLogits(torch.float32), True, "compiled"),
        (torch.empty(2, 3, dtype=torch.bfloat16), False, "recompute"),
        (torch.empty(2, 3, dtype=torch.bfloat16), True, "recompute"),
        (torch.empty(2, 3, dtype=torch.float32), False, "recompute"),
        (torch.empty(2, 3, dtype=torch.float32), True, "softmax"),
    ],
)
def test_auto_kernel_choice(logits, inplace, expected):
    assert resolve_kernel("auto", logits, inplace) == expected
    assert resolve_kernel("softmax", logits, inplace) == "softmax"
    with pytest.raises(ValueError, match="kernel must be one of"):
        resolve_kernel("triton", logits, inplace)


@pytest.mark.parametrize(
    "how, error, match",
    [
        (dict(kernel="fused"), ValueError, "kernel must be one of"),
        (dict(kernel="softmax", chunk_tokens=4), ValueError, "works on all rows at once"),
        (dict(kernel="recompute", chunk_tokens=0), ValueError, "chunk_tokens must be a positive"),
        (dict(chunk_tokens=2.5), ValueError, "chunk_tokens must be a positive"),
    ],
)
def test_bad_execution_choices_are_refused(how, error, match):
    labels, logits = one_token([0.0] * 10, 3)
    with pytest.raises(error, match=match):
        dm.numerical_lm_loss(labels, logits, dm.NumericalLossConfig(vocab=VOCAB), **how)


@pytest.mark.parametrize("field", ["kernel", "inplace", "validate", "chunk_tokens"])
def test_config_carries_meaning_only(field):
    """Execution choices are keyword arguments of the functions, never config fields."""
    with pytest.raises(TypeError):
        dm.NumericalLossConfig(vocab=VOCAB, **{field: None})


@pytest.mark.parametrize("chunk_tokens", [None, 1, 4])
def test_recompute_chunks_agree_with_the_softmax_kernel(chunk_tokens):
    labels = number_rich_labels(2, 5, seed=8)
    full = logits_for(5, 2, 64, seed=8).float()
    cfg = dm.NumericalLossConfig(alpha=0.5, vocab=SPLIT_VOCAB)
    results = []
    for how in (dict(kernel="softmax"), dict(kernel="recompute", chunk_tokens=chunk_tokens)):
        logits = full.clone().requires_grad_(True)
        loss = dm.numerical_lm_loss(labels, logits, cfg, **how)
        loss.sum().backward()
        results.append((loss.detach(), logits.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)


# ---- the "compiled" kernel -------------------------------------------------------------------


def _compiled_and_recompute(labels, full, cfg):
    """(loss, logits gradient) of the "compiled" and the "recompute" kernel."""
    results = []
    for kernel in ("compiled", "recompute"):
        logits = full.clone().requires_grad_(True)
        loss = dm.numerical_lm_loss(labels, logits, cfg, kernel=kernel)
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum().backward()
        results.append((loss.detach(), logits.grad))
    return results


@pytest.fixture
def eager_rows(monkeypatch):
    """Rows each eager pass is called with; an eager chunk of 4 rows of V 64 (fp32); the
    fallback's log forgotten."""
    from del_megatron.kernels import recompute

    rows = []
    monkeypatch.setattr(recompute, "EAGER_CHUNK_BYTES", 4 * 4 * 64)
    monkeypatch.setattr(recompute, "_FALLBACKS", set())
    monkeypatch.setattr(recompute, "_COMPILE_FAILED", set())
    for compiled_pass in recompute.passes(compiled=True):
        eager = compiled_pass.eager

        def spy(logits, *rest, eager=eager):
            rows.append(logits.size(0))
            return eager(logits, *rest)

        monkeypatch.setattr(compiled_pass, "eager", spy)
    return rows


def _fallback_logged(caplog) -> int:
    return sum("runs its passes eagerly in chunks" in r.getMessage() for r in caplog.records)


def test_compiled_kernel_without_dynamo_runs_eager_chunks(eager_rows, caplog):
    """TORCH_COMPILE_DISABLE=1 (torch._dynamo.config.disable): the "compiled" kernel takes the
    eager passes in chunks (never all rows at once, which would copy them all to fp32), with the
    same result as "recompute", and says so once."""
    labels = number_rich_labels(2, 9, seed=3)
    full = logits_for(9, 2, 64, seed=3).to(torch.bfloat16)
    cfg = dm.NumericalLossConfig(alpha=0.5, vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    for _ in range(2):
        with torch._dynamo.config.patch(disable=True):
            (compiled, recomputed) = _compiled_and_recompute(labels, full, cfg)
        assert torch.equal(compiled[0], recomputed[0]) and torch.equal(compiled[1], recomputed[1])
    assert eager_rows and max(eager_rows) == 4 and sum(eager_rows) == 4 * 18
    assert _fallback_logged(caplog) == 1


def test_compiled_kernel_after_a_compile_error_runs_eager_chunks(monkeypatch, eager_rows, caplog):
    """A compilation that fails (no C++ compiler or Triton, a backend error): the same eager
    chunks, logged once with the error, and no second attempt."""
    from del_megatron.kernels import recompute

    attempts = []

    def broken(*args):
        attempts.append(1)
        raise RuntimeError("backend compiler failed (stand-in)")

    for compiled_pass in recompute.passes(compiled=True):
        monkeypatch.setattr(compiled_pass, "compiled", broken)
    labels = number_rich_labels(2, 9, seed=4)
    full = logits_for(9, 2, 64, seed=4).float()
    cfg = dm.NumericalLossConfig(alpha=0.5, vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    for _ in range(2):
        (compiled, recomputed) = _compiled_and_recompute(labels, full, cfg)
        assert torch.equal(compiled[0], recomputed[0]) and torch.equal(compiled[1], recomputed[1])
    assert len(attempts) == 1 and max(eager_rows) == 4
    assert _fallback_logged(caplog) == 1
    assert "backend compiler failed (stand-in)" in caplog.text


def test_compiled_passes_hold_nothing_of_n_by_v_in_fp32():
    """TorchInductor's code for the two compiled passes (its CPU backend lowers the same graph as
    CUDA's): forward allocates [N] vectors only, backward one [N, V] buffer, the gradient in the
    logits' dtype (bf16), written once, and nothing [N, V] in fp32."""
    import re

    from torch._inductor.utils import run_and_get_code

    from del_megatron.kernels import recompute

    first, second = recompute.passes(compiled=True)
    n, v = 37, 300
    logits = torch.randn(n, v).to(torch.bfloat16)
    row = torch.rand(n)
    onehot = torch.randint(-1, v, (n,))
    allocations = []
    for fn, args in ((first, (logits,)), (second, (logits, row, row, row, onehot))):
        (_, code) = run_and_get_code(fn.compiled, *args)
        found = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), (\S+)\)", code[0])
        allocations.append([(shape.strip(), dtype) for shape, dtype in found])
    forward, backward = allocations
    assert forward and all(shape.count(",") == 1 and shape.endswith(",") for shape, _ in forward)
    two_d = [(shape, dtype) for shape, dtype in backward if not shape.endswith(",")]
    assert len(two_d) == 1 and two_d[0][1] == "torch.bfloat16", backward
    assert all(dtype != "torch.float32" or shape.endswith(",") for shape, dtype in backward)
    grad = second(logits, row, row, row, onehot)
    eager = recompute.softmax_minus_onehot(logits, row, row, row, onehot)
    torch.testing.assert_close(grad, eager, rtol=8e-3, atol=1e-6)


def test_a_device_failure_inside_a_compiled_pass_is_not_taken_for_a_compile_failure(
    eager_rows, monkeypatch, caplog
):
    """A failed device-side check on CUDA surfaces asynchronously, possibly inside a compiled
    pass: it must propagate as it is, not be logged as 'torch.compile failed' and retried
    eagerly (audit G7)."""
    from del_megatron.kernels import recompute

    def dead_context(*args):
        raise RuntimeError("CUDA error: device-side assert triggered")

    first_pass, _ = recompute.passes(compiled=True)
    monkeypatch.setattr(first_pass, "compiled", dead_context)
    labels = number_rich_labels(2, 9, seed=3)
    logits = logits_for(9, 2, 64, seed=3).float()
    cfg = dm.NumericalLossConfig(alpha=0.5, vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    with pytest.raises(RuntimeError, match="device-side assert"):
        dm.numerical_lm_loss(labels, logits, cfg, kernel="compiled")
    assert not recompute._COMPILE_FAILED and not eager_rows
    assert _fallback_logged(caplog) == 0


def test_the_parallel_layout_is_one_object_and_the_loose_keywords_still_work_with_a_warning():
    """VocabParallelLayout carries the split (here packed documents); 0.1's loose keywords give
    the same loss with one FutureWarning naming the object to pass; both at once, or a keyword
    the function does not take, are refused."""
    from del_megatron.layout import layout_of

    labels = torch.tensor([[SPLIT_VOCAB.digit_ids[k % 10] for k in range(12)]])  # one number
    logits = logits_for(12, 1, 64, seed=3)
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    cu = torch.tensor([0, 5, 12])
    layout = dm.VocabParallelLayout(cu_seqlens=cu)
    want = dm.numerical_lm_loss(labels, logits, cfg, layout)
    whole = dm.numerical_lm_loss(labels, logits, cfg)
    assert not torch.equal(want, whole)  # teeth: the document start splits a number
    with pytest.warns(FutureWarning, match=r"numerical_lm_loss\(cu_seqlens=\) is deprecated"):
        loose = dm.numerical_lm_loss(labels, logits, cfg, cu_seqlens=cu)
    torch.testing.assert_close(loose, want, rtol=0, atol=0)
    with pytest.warns(FutureWarning, match=r"loss_parts\(cu_seqlens=\)"):
        parts = dm.loss_parts(labels, logits, cfg, cu_seqlens=cu)
    torch.testing.assert_close(parts.term, dm.loss_parts(labels, logits, cfg, layout).term)
    with pytest.raises(TypeError, match="give the layout only"):
        dm.numerical_lm_loss(labels, logits, cfg, layout, cu_seqlens=cu)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sequence_parallel'"):
        dm.numerical_lm_loss(labels, logits, cfg, sequence_parallel=True)
    group = object()  # the old positional tp_group
    with pytest.warns(FutureWarning, match=r"f\(tp_group=\)"):
        assert layout_of("f", group, {}).tp_group is group
    with pytest.raises(ValueError, match="cp_balancing must be one of"):
        dm.VocabParallelLayout(cp_balancing="documents")
