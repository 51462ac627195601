"""Megatron-LM glue without a model: telemetry by hand, the digit reduction, the flags."""

import argparse
import types

import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.loss import loss_parts
from del_megatron.megatron import registration as reg
from del_megatron.reference import reference_lm_loss

# ids 0..9 digits, 10 '.', vocab 16
VOCAB = dm.DigitVocab(range(10), [10])


def hand_batch():
    """labels [1, 4] = '3', '1', 'x', '7' with loss mask 1, 1, 1, 0. Digit logits are a bump of
    4 at the predicted digit: 3 (right), 2 (wrong), -, 7 (right but masked)."""
    labels = torch.tensor([[3, 1, 12, 7]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    logits = torch.zeros(4, 1, 16, dtype=torch.float64)
    for pos, predicted in ((0, 3), (1, 2), (2, 5), (3, 7)):
        logits[pos, 0, predicted] = 4.0
    return labels, mask, logits


def through_loss_func(labels, mask, logits, cfg):
    """(loss, num_tokens, report, output) of Megatron-LM's loss_func wrapper on the hook's
    recorded output for these logits, registered for cfg."""
    parts = loss_parts(labels, logits, dm.NumericalLossConfig(loss="del", vocab=cfg.vocab))
    output = parts.token_loss(cfg.token_weight)
    dmm.register(cfg)
    try:
        reg.record(output, parts, cfg)
        loss, num_tokens, report = dmm.numerical_loss_func(mask, output)
    finally:
        dmm.unregister()
    return loss, num_tokens, report, output


@pytest.mark.parametrize("reduction", ["token", "digit"])
def test_telemetry_and_reduction_by_hand(reduction):
    labels, mask, logits = hand_batch()
    share = 0.5 if reduction == "token" else None
    cfg = dm.NumericalLossConfig(
        loss="del", alpha=0.2, vocab=VOCAB, reduction=reduction, digit_share=share
    )
    loss, num_tokens, report, output = through_loss_func(labels, mask, logits, cfg)
    assert reg.find(output) is None  # unregister() forgets the records

    # By hand: "31" is one number (tens, units: w = 4, 2); 'x' is not a digit; '7' is masked.
    ce, term = reference_lm_loss(labels, logits, VOCAB, loss="del")
    ce_sum = ce[0, 0] + ce[0, 1] + ce[0, 2]
    term_sum = term[0, 0] + term[0, 1]
    assert term[0, 0] / term[0, 0].new_tensor(4.0) == pytest.approx((term[0, 0] / 4).item())
    assert num_tokens.item() == 3
    assert report["digit acc"].tolist() == [1.0, 2.0]  # '3' right, '1' predicted as 2
    assert report["digit tokens"].tolist() == [2.0, 1.0]
    assert report["digit share"].tolist() == [2.0, 3.0]
    assert report["del term"].tolist() == pytest.approx([term_sum.item(), 2.0])
    assert report["ce loss"].tolist() == pytest.approx([ce_sum.item(), 3.0])
    if reduction == "token":  # each digit's term weighs alpha / digit_share = 0.4
        expected = ce_sum + 0.4 * term_sum
        # the weight on the mean term: 0.4 x 2 digits / 3 tokens (alpha x measured / given)
        assert report["del weight"].tolist() == pytest.approx([0.8, 3.0])
    else:  # mean CE over 3 tokens + alpha * mean term over 2 digits, in Megatron's sum units
        expected = 3 * (ce_sum / 3 + 0.2 * term_sum / 2)
        assert report["del weight"].tolist() == pytest.approx([0.4, 2.0])  # alpha itself
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert report["lm loss"].tolist() == pytest.approx([expected.item(), 3.0], rel=1e-6)


def test_digit_free_micro_batches_report_zero_not_nan():
    """Megatron-LM divides each entry's sum by its count: a micro-batch (or step) without digit
    targets must give 0, and a count >= 1 must stay exact in float32."""
    labels = torch.tensor([[12, 13, 12]])
    logits = torch.zeros(3, 1, 16)
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.2, vocab=VOCAB)
    parts = loss_parts(labels, logits, cfg)
    output = parts.token_loss(0.2)
    dmm.register(cfg)
    try:
        reg.record(output, parts, cfg)
        _, _, report = dmm.numerical_loss_func(torch.ones(1, 3), output)
    finally:
        dmm.unregister()
    for key in ("del term", "digit acc", "digit tokens", "digit share"):
        total, count = report[key].tolist()
        assert total / count == pytest.approx(0.0, abs=1e-19) and total / count >= 0, key
    assert report["digit share"][1].item() == 3.0  # 3 + COUNT_EPS is 3 in float32


def test_loss_func_passes_through_outputs_it_did_not_make():
    out = torch.ones(1, 3)
    loss, num_tokens, report = dmm.numerical_loss_func(torch.ones(1, 3), out)
    assert loss.item() == 3 and set(report) == {"lm loss"}


def test_place_weight_of_the_hand_batch():
    labels, _, _ = hand_batch()
    assert dm.place_weights(labels, VOCAB).tolist() == [[4.0, 2.0, 0.0, 2.0]]


def parse(argv, provider=None):
    parser = argparse.ArgumentParser()
    (provider or dmm.add_arguments)(parser)
    return parser.parse_args(argv)


def test_flags_defaults_and_explicit_ids():
    args = parse([])
    assert (args.numerical_loss, args.del_alpha, args.del_reduction) == (None, 0.1, "digit")
    assert args.del_digit_share is None
    assert dmm.config_from_args(args).loss == "ce"
    args = parse(
        "--numerical-loss del --del-alpha 0.1 --del-reduction digit "
        "--del-digit-token-ids 5 6 7 8 9 10 11 12 13 14 --del-decimal-point-token-ids 3".split()
    )
    cfg = dmm.config_from_args(args)
    assert cfg == dm.NumericalLossConfig(
        loss="del", alpha=0.1, reduction="digit", vocab=dm.DigitVocab(range(5, 15), [3])
    )


def test_logits_free_flag_takes_an_optional_weight_gradient_route():
    from del_megatron.megatron.logits_free import weight_gradient_of

    assert parse([]).del_logits_free is False
    assert parse(["--del-logits-free"]).del_logits_free == "auto"
    for route in ("auto", "forward", "backward"):
        assert parse(["--del-logits-free", route]).del_logits_free == route
        assert weight_gradient_of(route) == route
    assert parse(["--del-logits-free", "--numerical-loss", "del"]).numerical_loss == "del"
    with pytest.raises(SystemExit):
        parse(["--del-logits-free", "sideways"])
    assert (weight_gradient_of(False), weight_gradient_of(True)) == (None, "auto")
    with pytest.raises(ValueError, match="logits_free must be True, False or a weight-gradient"):
        weight_gradient_of("sideways")


def test_flags_chain_with_another_provider():
    def other(parser):
        parser.add_argument("--other-flag", type=int, default=3)
        return parser

    args = parse(
        ["--other-flag", "4", "--numerical-loss", "ntl_was"],
        dmm.chain_extra_args(other, None, dmm.add_arguments),
    )
    assert args.other_flag == 4 and args.numerical_loss == "ntl_was"


def test_flags_refuse_what_cannot_work():
    with pytest.raises(SystemExit):
        parse(["--numerical-loss", "mse"])
    with pytest.raises(SystemExit):
        parse(["--del-digit-token-ids", "1", "2"])
    args = parse(["--numerical-loss", "del"])
    with pytest.raises(ValueError, match="no tokenizer to read them from: pass --del-digit"):
        dmm.config_from_args(args)
    args.tokenizer_type = "NullTokenizer"
    with pytest.raises(ValueError, match="the NullTokenizer has no text .* --del-digit-token-ids"):
        dmm.config_from_args(args, tokenizer=object())
    args = parse("--numerical-loss del --del-digit-token-ids 0 1 2 3 4 5 6 7 8 99".split())
    args.padded_vocab_size = 64
    with pytest.raises(ValueError, match=r"ids \[99\] lie outside"):
        dmm.config_from_args(args)


def digit_grouping_bpe(digits: str = r"\d{1,3}", special_tokens=()):
    r"""A Llama-3-style byte-level BPE whose pre-tokenizer groups digits by three (`digits`:
    another grouping, Qwen's one digit a token r"\p{N}"), with `special_tokens` added."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(digits), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{i} + {i * 7} = {i * 8}. pi is 3.14159, e is 2.71828" for i in range(2000)]
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(special_tokens),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def test_tokenizer_that_merges_digits_stops_the_run_before_training():
    tok = digit_grouping_bpe()
    args = parse(["--numerical-loss", "del"])
    with pytest.raises(ValueError, match="merges digits into multi-digit tokens"):
        dmm.config_from_args(args, tokenizer=tok)
    args = parse(["--numerical-loss", "del", "--del-allow-multi-digit-tokens"])
    vocab = dmm.config_from_args(args, tokenizer=tok).vocab
    assert [tok.decode([i]) for i in vocab.digit_ids] == [str(d) for d in range(10)]


@pytest.mark.parametrize("impl", ["native", "te"])
def test_the_fused_cross_entropy_log_says_what_replaces_it_and_at_what_memory(impl):
    """--cross-entropy-fusion-impl te: the materialised loss holds one more logits-sized buffer
    than TE's in-place kernel (said in bytes a logit); logits-free holds none. Never "the same
    passes"."""
    from del_megatron.megatron.refusals import fusion_replacement

    kept, free = fusion_replacement(impl), fusion_replacement(impl, "forward")
    if impl == "te":
        assert "Transformer Engine" in kept and "one more [s, b, V/tp] buffer" in kept, kept
        assert "4 against TE's 2" in kept, kept
    assert "logits-free" in free and "route 'forward'" in free, free
    assert "no [s, b, V/tp] logits or gradient held" in free, free
    assert "same passes" not in kept + free


@pytest.mark.parametrize(
    "flags, balancing",
    [
        (dict(), "document"),
        (dict(dataloader_inter_document_masking=True), "sequence"),
        (dict(dataloader_inter_document_masking=True, sft=True), "document"),
    ],
)
def test_register_from_args_tells_the_hook_how_packed_batches_are_cut_over_cp(flags, balancing):
    """Megatron-LM core 0.19's get_batch cuts a packed batch over CP ranks by the whole sequence
    under --dataloader-inter-document-masking without --sft, else per document: the registration
    carries which, and the hook cuts the labels the same way (tests/megatron_workers/
    context_parallel.py, check_hook_passes_the_cp_group)."""
    from del_megatron.megatron import lm
    from del_megatron.megatron import registration as reg

    args = parse(["--numerical-loss", "del", "--del-digit-token-ids", *map(str, range(5, 15))])
    args.padded_vocab_size = 64
    for name, value in flags.items():
        setattr(args, name, value)
    try:
        lm.register_from_args(args, tokenizer=None)
        assert reg.current().cp_balancing == balancing
    finally:
        dmm.unregister()
    with pytest.raises(ValueError, match="cp_balancing must be one of"):
        dmm.register(cp_balancing="documents")


@pytest.mark.parametrize("switch", ["gradient_accumulation_fusion", "fuse_wgrad_accumulation"])
def test_logits_free_takes_main_grad_under_either_name_of_the_fusion(switch):
    """Megatron's layers call gradient-accumulation fusion gradient_accumulation_fusion,
    Transformer Engine's (the MXFP8 output layer) fuse_wgrad_accumulation: under either, the
    logits-free loss adds the weight gradient to main_grad and returns Megatron's placeholder
    (audit G6)."""
    from del_megatron.megatron.logits_free import main_grad_sink

    weight = torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))
    weight.main_grad = torch.zeros(8, 4)
    weight.grad_added_to_main_grad = False
    layer = types.SimpleNamespace(**{switch: True})
    sink = main_grad_sink(layer, weight)
    assert sink is not None and sink.accumulator is weight.main_grad
    placeholder = sink.returned()
    assert placeholder.shape == weight.shape and weight.grad_added_to_main_grad
    assert main_grad_sink(types.SimpleNamespace(), weight) is None
