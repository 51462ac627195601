"""DEL for tokenizers that cut numbers into chunks of up to three digits (docs/DEL.md, "Tokenizers
that put up to three digits in a token"): the vocab, the place weights of every digit against
the fp64 oracle, the oracle against the worked values, and the oracle against the one-digit
definition, bit for bit."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import del_megatron as dm
from del_megatron.digits.numbers import del_weights, dist2_weights, number_layout
from del_megatron.digits.vocab import multi_digit_text
from del_megatron.reference import (
    reference_del_token,
    reference_lm_loss,
    reference_place_weights,
    slot_logits,
)

from . import chunked_workers
from .cases import TOKEN_FORM, token_share

# A chunking toy vocabulary: '0'..'9' are ids 0..9, '00'..'99' then '000'..'999' ids 10..1109,
# '.' 1110 (and ',' 1111, a second point id), space 1112, end of document 1113.
CHUNKED = dm.DigitVocab(range(10), [1110, 1111], range(10, 1110))
POINT, COMMA, SPACE, EOD, IGNORE = 1110, 1111, 1112, 1113, -100
VOCAB_SIZE = 1114
ID_OF = {text: i for i, text in CHUNKED.number_tokens()}


def chunks(text: str):
    """Token ids of `text` cut as a \\p{N}{1,3} pre-tokenizer cuts it: digits left to right in
    chunks of up to three."""
    out, digits = [], ""
    other = {".": POINT, ",": COMMA, " ": SPACE, "|": EOD, "_": IGNORE}
    for c in text + " ":
        if c.isdigit():
            digits += c
            continue
        out += [ID_OF[digits[i : i + 3]] for i in range(0, len(digits), 3)]
        digits = ""
        out.append(other[c])
    return out[:-1]


def test_vocab_lists_all_number_tokens_in_order():
    assert CHUNKED.chunked and CHUNKED.max_digits == 3
    texts = [t for _, t in CHUNKED.number_tokens()]
    assert texts[:12] == ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "00", "01"]
    assert texts[109] == "99" and texts[110] == "000" and texts[-1] == "999"
    assert len(set(texts)) == 1110
    assert multi_digit_text(7) == "07" and multi_digit_text(107) == "007"
    single = CHUNKED.single_digits_only()
    assert not single.chunked and single.digit_ids == CHUNKED.digit_ids
    assert single.decimal_point_ids == CHUNKED.decimal_point_ids


def test_vocab_refuses_an_incomplete_or_overlapping_set():
    with pytest.raises(ValueError, match="all 1100 two- and three-digit"):
        dm.DigitVocab(range(10), [], range(10, 110))  # two-digit tokens only
    with pytest.raises(ValueError, match="distinct"):
        dm.DigitVocab(range(10), [], [10] * 1100)
    with pytest.raises(ValueError, match="multi-digit tokens and as digits"):
        dm.DigitVocab(range(10), [1110], range(9, 1109))


@pytest.mark.parametrize(
    "text,expected",
    [
        # 12345 = 123 45: the 1 weighs 10, the 5 weighs 2 (the example)
        ("12345", [[10, 8, 6], [4, 2, 0]]),
        ("7", [[2, 0, 0]]),
        ("0042", [[8, 6, 4], [2, 0, 0]]),
        # 3.14159 = 3 . 141 59: the same weights as one digit a token
        (
            "3.14159",
            [[2, 0, 0], [0, 0, 0]] + [[1.02**-2, 1.02**-3, 1.02**-4]] + [[1.02**-5, 1.02**-6, 0]],
        ),  # fmt: skip
        # a second point still takes a place, as with one digit a token
        ("1.2.3", [[2, 0, 0], [0, 0, 0], [1.02**-2, 0, 0], [0, 0, 0], [1.02**-4, 0, 0]]),
        ("1234|5", [[8, 6, 4], [2, 0, 0], [0, 0, 0], [2, 0, 0]]),  # a document end ends it
    ],
)
def test_place_weights_of_chunked_numbers(text, expected):
    labels = torch.tensor([chunks(text)])
    fast = dm.place_weights(labels, CHUNKED)
    assert fast.shape == (1, labels.size(1), 3)
    torch.testing.assert_close(fast[0].double(), torch.tensor(expected, dtype=torch.float64))
    oracle = reference_place_weights(labels, CHUNKED)
    torch.testing.assert_close(oracle[0], torch.tensor(expected, dtype=torch.float64))


def test_layout_counts_digits_not_tokens():
    labels = torch.tensor([chunks("12345 6.75")])
    layout = number_layout(labels, CHUNKED)
    assert layout.digit_count.tolist() == [[3, 2, 0, 1, 0, 2]]
    assert layout.digit[0, 0].tolist() == [1, 2, 3] and layout.digit[0, 1].tolist() == [4, 5, 0]
    assert layout.is_digit.tolist() == [[True, True, False, True, False, True]]
    # DIST2 counts digits too: its runs are runs of number tokens (a point ends one)
    assert dist2_weights(layout)[0].tolist() == [
        [5, 4, 3], [2, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [2, 1, 0]
    ]  # fmt: skip


_pieces = st.sampled_from(["1", "22", "305", "007", "4", "0", ".", ",", " ", "|", "_", "99"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_pieces, min_size=1, max_size=14), min_size=1, max_size=3))
def test_property_place_weights_match_the_oracle(rows):
    encoded = [[t for piece in row for t in chunks(piece)] for row in rows]
    width = max(len(r) for r in encoded)
    labels = torch.tensor([r + [SPACE] * (width - len(r)) for r in encoded])
    layout = number_layout(labels, CHUNKED)
    torch.testing.assert_close(
        del_weights(layout).double(), reference_place_weights(labels, CHUNKED), rtol=1e-7, atol=0
    )
    torch.testing.assert_close(
        dist2_weights(layout).double(),
        reference_place_weights(labels, CHUNKED, scheme="dist2"),
        rtol=0,
        atol=0,
    )


def _whole_number_12(logit_of_12: float) -> float:
    labels = torch.tensor([[ID_OF["12"]]])
    logits = torch.zeros(1, 1, VOCAB_SIZE, dtype=torch.float64)
    logits[0, 0, ID_OF["12"]] = logit_of_12
    _, term = reference_lm_loss(labels, logits, CHUNKED)
    return float(term)


def test_oracle_gives_the_worked_values():
    # docs/DEL.md: all logits 0, label the whole number '12' (one token)
    logits = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
    z1, z2 = slot_logits(logits, CHUNKED, "12")
    torch.testing.assert_close(z1, torch.full((10,), math.log(111), dtype=torch.float64))
    torch.testing.assert_close(z2, torch.full((10,), math.log(11), dtype=torch.float64))
    assert float(reference_del_token(z1, 1)) == pytest.approx(0.4247546, abs=5e-8)
    assert float(reference_del_token(z2, 2)) == pytest.approx(0.2245117, abs=5e-8)
    assert _whole_number_12(0.0) == pytest.approx(2.1480418, abs=5e-8)
    assert _whole_number_12(3.0) == pytest.approx(2.0529749, abs=5e-8)


def test_oracle_on_one_digit_tokens_is_the_one_digit_definition_bit_for_bit():
    vocab = dm.DigitVocab(range(20, 30), [7])
    labels = torch.tensor([[21, 22, 7, 25, 3, 29]])
    logits = torch.randn(6, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, term = reference_lm_loss(labels, logits, vocab)
    weights = reference_place_weights(labels, vocab)
    for pos, label in enumerate(labels[0].tolist()):
        expected = torch.zeros((), dtype=torch.float64)
        if 20 <= label < 30:
            z = logits[pos, 0, 20:30]
            expected = weights[0, pos] * reference_del_token(z, label - 20)
        assert torch.equal(term[0, pos], expected), pos


MATERIALISED = [(1, "softmax"), (1, "compiled"), (2, "recompute"), (2, "compiled")]
MATERIALISED += [(4, "softmax"), (4, "recompute")]


@pytest.mark.parametrize("tp, kernel", MATERIALISED, ids=[f"tp{t}-{k}" for t, k in MATERIALISED])
def test_kernels_match_the_oracle(gloo, tp, kernel):
    gloo(tp).run(chunked_workers.check_materialised, 40 + tp, kernel)


@pytest.mark.parametrize("kernel", ["softmax", "recompute"])
def test_each_rank_sends_slot_sums_not_number_logits(gloo, kernel):
    gloo(2).run(chunked_workers.check_collectives_carry_slot_sums, 9, kernel)


def test_digit_reduction_counts_digits(gloo):
    gloo(2).run(chunked_workers.check_digit_reduction_counts_digits, 7, "recompute")


LOGITS_FREE = [(1, "forward"), (2, "forward"), (2, "backward"), (4, "backward")]


@pytest.mark.parametrize("tp, route", LOGITS_FREE, ids=[f"tp{t}-{r}" for t, r in LOGITS_FREE])
def test_logits_free_matches_the_oracle(gloo, tp, route):
    gloo(tp).run(chunked_workers.check_logits_free, 60 + tp, route)


def test_worked_values_through_the_package():
    labels = torch.tensor([[ID_OF["12"]]])
    for hot, expected in ((0.0, 2.1480418), (3.0, 2.0529749)):
        logits = torch.zeros(1, 1, VOCAB_SIZE)
        logits[0, 0, ID_OF["12"]] = hot
        cfg = dm.NumericalLossConfig(loss="del", vocab=CHUNKED, slot_logits="any", **TOKEN_FORM)
        parts = dm.loss_parts(labels, logits, cfg)
        assert float(parts.term) == pytest.approx(expected, abs=2e-7)
        assert parts.digit_count.tolist() == [[2]] and int(parts.n_digits) == 2


@pytest.mark.parametrize("reduction", ["token", "digit"])
def test_megatron_telemetry_and_reduction_count_digits(reduction):
    from .test_megatron_glue import through_loss_func

    # '123' '4' then '9' (masked) and a space: 4 digit targets in 3 loss tokens of 4
    labels = torch.tensor([[ID_OF["123"], ID_OF["4"], ID_OF["9"], SPACE]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    logits = torch.randn(4, 1, VOCAB_SIZE, generator=torch.Generator().manual_seed(2))
    logits[0, 0, ID_OF["123"]] = 30.0  # slots 1-3 of '123' predicted right
    cfg = dm.NumericalLossConfig(
        loss="del",
        alpha=0.2,
        vocab=CHUNKED,
        reduction=reduction,
        digit_share=token_share(reduction),
    )
    loss, num_tokens, report, _ = through_loss_func(labels, mask, logits, cfg)
    parts = dm.loss_parts(labels, logits, cfg)
    ce, term = reference_lm_loss(labels, logits, CHUNKED, loss="del", slot_rule=cfg.slot_logits)
    ce_sum, term_sum = ce[0, 0] + ce[0, 1] + ce[0, 3], term[0, 0] + term[0, 1]
    assert num_tokens.item() == 3
    assert report["digit tokens"].tolist() == [4.0, 1.0]
    assert report["digit share"].tolist() == [4.0, 3.0]
    assert report["del term"].tolist() == pytest.approx([term_sum.item(), 4.0], rel=1e-5)
    correct = 3 + int(parts.digit_logits[0, 1, 0].argmax() == 4)
    assert report["digit acc"].tolist() == [float(correct), 4.0]
    if reduction == "token":
        expected = ce_sum + 0.2 * term_sum
    else:  # mean CE over 3 tokens + alpha * mean term over 4 digits, in Megatron's sum units
        expected = 3 * (ce_sum / 3 + 0.2 * term_sum / 4)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_megatron_flags_and_model_config_keep_the_number_tokens():
    import argparse

    from tokenizers import Tokenizer

    from del_megatron import megatron as dmm

    from .test_tokenizers import LLAMA3_TOKENIZER

    tok = Tokenizer.from_file(str(LLAMA3_TOKENIZER))
    parser = dmm.add_arguments(argparse.ArgumentParser())
    slots = parser.parse_args(["--numerical-loss", "del", "--del-slot-logits", "length"])
    cfg = dmm.config_from_args(slots, tokenizer=tok)
    assert cfg.vocab.chunked and len(cfg.vocab.multi_digit_ids) == 1100
    for single in (["--del-single-digits-only"], []):  # without a slot rule: single digits
        args = parser.parse_args(["--numerical-loss", "del", *single])
        fallback = dmm.config_from_args(args, tokenizer=tok).vocab
        assert not fallback.chunked and fallback.digit_ids == cfg.vocab.digit_ids

    class ModelConfig:  # what Bridge's provider / Megatron's TransformerConfig carry
        pass

    model_config = ModelConfig()
    for name, value in cfg.to_fields().items():
        setattr(model_config, name, value)
    assert dm.NumericalLossConfig.from_fields(model_config) == cfg


def test_check_reports_the_real_llama3_file_as_chunking():
    from del_megatron.tools.preflight import check_tokenizer, report

    from .test_tokenizers import LLAMA3_TOKENIZER

    result = check_tokenizer(str(LLAMA3_TOKENIZER.parent), "HuggingFaceTokenizer")
    assert result.ok and result.chunked
    text = report(result)
    assert "chunks of up to three digits" in text and "1,110 number tokens" in text
    assert text.splitlines()[-1].endswith(
        "--numerical-loss del --del-alpha 0.1 --del-reduction digit"
    )


@pytest.mark.parametrize("kernel", ["recompute", "softmax"])
def test_context_parallel_and_packed_documents(gloo, kernel):
    gloo(2).run(chunked_workers.check_cp_and_packing, 9, kernel)


# The "length" rule (docs/DEL.md): candidates of the label's own number of digits only,
# prefix-conditional, lifted to one level.
def _whole_number_12_length(logit_of_12: float) -> float:
    labels = torch.tensor([[ID_OF["12"]]])
    logits = torch.zeros(1, 1, VOCAB_SIZE, dtype=torch.float64)
    logits[0, 0, ID_OF["12"]] = logit_of_12
    _, term = reference_lm_loss(labels, logits, CHUNKED, slot_rule="length")
    return float(term)


def test_length_rule_oracle_gives_the_worked_values():
    logits = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
    z1, z2 = slot_logits(logits, CHUNKED, "12", "length")
    torch.testing.assert_close(z1, torch.full((10,), math.log(10), dtype=torch.float64))
    torch.testing.assert_close(z2, torch.full((10,), math.log(10), dtype=torch.float64))
    assert float(reference_del_token(z1, 1)) == pytest.approx(0.2167637, abs=5e-8)
    assert _whole_number_12_length(0.0) == pytest.approx(1.3005821, abs=5e-8)
    logits[ID_OF["12"]] = 3.0
    z1, z2 = slot_logits(logits, CHUNKED, "12", "length")
    assert float(z1[1]) == pytest.approx(math.log(9 + math.exp(3)), abs=1e-12)
    assert float(z2[2]) == pytest.approx(4.409601, abs=5e-7)
    assert float(z2[0]) == pytest.approx(1.409601, abs=5e-7)
    assert float(reference_del_token(z1, 1)) == pytest.approx(0.1820488, abs=5e-8)
    assert float(reference_del_token(z2, 2)) == pytest.approx(0.0512141, abs=5e-8)
    assert _whole_number_12_length(3.0) == pytest.approx(0.8306234, abs=5e-8)


def test_length_rule_worked_values_through_the_package():
    labels = torch.tensor([[ID_OF["12"]]])
    for hot, expected in ((0.0, 1.3005821), (3.0, 0.8306234)):
        logits = torch.zeros(1, 1, VOCAB_SIZE)
        logits[0, 0, ID_OF["12"]] = hot
        cfg = dm.NumericalLossConfig(loss="del", vocab=CHUNKED, slot_logits="length")
        assert float(dm.loss_parts(labels, logits, cfg).term) == pytest.approx(expected, abs=5e-7)


@pytest.mark.parametrize("kernel", ["softmax", "recompute"])
def test_length_rule_on_one_digit_labels_is_del_on_the_digit_tokens_bit_for_bit(kernel):
    labels = torch.tensor([chunks("7 3.5 0 9|4 1_2")])
    logits = torch.randn(labels.size(1), 1, VOCAB_SIZE, generator=torch.Generator().manual_seed(4))
    chunked = dm.NumericalLossConfig(loss="del", vocab=CHUNKED, slot_logits="length")
    single = dm.NumericalLossConfig(loss="del", vocab=CHUNKED.single_digits_only())
    ours = dm.loss_parts(labels, logits, chunked, kernel=kernel)
    one_digit = dm.loss_parts(labels, logits, single, kernel=kernel)
    digits = one_digit.is_digit
    assert torch.equal(ours.digit_logits[..., 0, :][digits], one_digit.digit_logits[digits])
    assert torch.equal(ours.term, one_digit.term) and bool(ours.term.gt(0).any())


@pytest.mark.parametrize("rule", ["length", "any"])
def test_length_rule_sends_no_gradient_to_wrong_length_tokens(rule):
    # label '123': under "length" the term moves only the three-digit tokens' logits; under
    # "any" it pushes up the prefix '12' (the review's table: -10.4e-3 at logits 0)
    labels = torch.tensor([[ID_OF["123"]]])
    logits = torch.zeros(1, 1, VOCAB_SIZE, requires_grad=True)
    cfg = dm.NumericalLossConfig(loss="del", vocab=CHUNKED, slot_logits=rule)
    dm.loss_parts(labels, logits, cfg).term.sum().backward()
    grad = logits.grad[0, 0]
    lengths = torch.zeros(VOCAB_SIZE, dtype=torch.long)
    for i, text in CHUNKED.number_tokens():
        lengths[i] = len(text)
    if rule == "length":
        assert bool(grad[lengths != 3].eq(0).all()) and bool(grad[lengths == 3].ne(0).any())
        assert float(grad[ID_OF["123"]]) < 0
    else:
        assert float(grad[ID_OF["12"]]) == pytest.approx(-10.4e-3, abs=5e-5)


def test_compare_scores_length_accuracy_and_digit_entropy_by_hand():
    from del_megatron.tools.demo.evaluate import digit_distributions

    # '12' whose likeliest number token is '123' (a length miss), then '7' whose likeliest is
    # '5' (a hit), then an unscored position
    labels = torch.tensor([[ID_OF["12"], ID_OF["7"], IGNORE]])
    logits = torch.zeros(1, 3, VOCAB_SIZE)
    logits[0, 0, ID_OF["123"]] = 2.0
    logits[0, 1, ID_OF["5"]] = 3.0
    hits, numbers, shape = digit_distributions(logits, labels, CHUNKED)
    entropy, digits = shape["entropy"], shape["count"]
    assert (hits.tolist(), numbers.tolist(), digits.tolist()) == ([1], [2], [3])
    # '12': both "length" slots are uniform over the two-digit tokens (ln 10 each); '7': the
    # ten digit logits with '5' at 3
    p = math.exp(3) / (9 + math.exp(3))
    q = 1 / (9 + math.exp(3))
    expected = 2 * math.log(10) - p * math.log(p) - 9 * q * math.log(q)
    assert float(entropy[0]) == pytest.approx(expected, abs=1e-6)
