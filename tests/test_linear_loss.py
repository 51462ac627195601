"""The logits-free path (numerical_linear_loss) equals the materialised-logits path."""

import pytest
import torch

import del_megatron as dm

from . import linear_workers
from .cases import PADDED_VOCAB_SIZE, SPLIT_VOCAB

CFG = dm.NumericalLossConfig(vocab=SPLIT_VOCAB)
LABELS = torch.zeros(2, 5, dtype=torch.long)

CASES = [
    pytest.param(tp, check, id=f"tp{tp}-{check.removeprefix('check_')}")
    for tp in (1, 2, 4)
    for check in linear_workers.checks_for(tp)
]


@pytest.mark.parametrize("tp, check", CASES)
def test_logits_free_equals_materialised(gloo, tp, check):
    gloo(tp).run(getattr(linear_workers, check), 4321 + tp)


def test_logits_free_under_tensor_sequence_and_context_parallelism(gloo):
    workers = gloo(4, tensor_model_parallel_size=2, context_parallel_size=2)
    workers.run(linear_workers.check_tp_sp_and_cp, 99)


@pytest.mark.parametrize(
    "hidden, weight, labels, kwargs, error, match",
    [
        (torch.randn(5, 2), torch.randn(64, 4), LABELS, {}, ValueError, r"hidden must be \[seq"),
        (torch.randn(5, 2, 4), torch.randn(64, 3), LABELS, {}, ValueError, r"weight must be"),
        (torch.randn(5, 2, 4), torch.randn(64), LABELS, {}, ValueError, r"weight must be"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4, dtype=torch.float64),
            LABELS,
            {},
            TypeError,
            "share one floating dtype",
        ),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.t(), {}, ValueError, r"labels must be"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.float(), {}, TypeError, "integer tensor"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS + 64, {}, ValueError, "outside the voc"),
        (torch.randn(5, 2, 4), torch.randn(8, 4), LABELS, {}, ValueError, "vocab"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"chunk_tokens": 0},
            ValueError,
            "chunk",
        ),
        (torch.randn(5, 2, 4), [[1.0]], LABELS, {}, TypeError, "weight must be a torch.Tensor"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"kernel": "softmax"},
            ValueError,
            "one kernel, 'linear'",
        ),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS, {"kernel": "x"}, ValueError, "one of"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"inplace": True},
            ValueError,
            "keeps no logits",
        ),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"weight_gradient": "sideways"},
            ValueError,
            r"weight_gradient must be one of \('auto', 'forward', 'backward'\)",
        ),
    ],
)
def test_bad_input_is_refused(hidden, weight, labels, kwargs, error, match):
    with pytest.raises(error, match=match):
        dm.numerical_linear_loss(hidden, weight, labels, CFG, **kwargs)


def test_default_chunk_holds_no_more_than_256_mib_of_logits_nor_an_eighth_of_the_tokens():
    from del_megatron.kernels.linear import default_chunk_tokens

    assert default_chunk_tokens(151936, 4096) == 441  # 256 MiB of fp32 logits
    assert default_chunk_tokens(151936 // 2, 4096) == 512  # TP 2: an eighth of the tokens
    assert default_chunk_tokens(151936, 100) == 13
    assert default_chunk_tokens(PADDED_VOCAB_SIZE, 10**6) * PADDED_VOCAB_SIZE * 4 <= 256 * 2**20
    assert default_chunk_tokens(2**40, 10**6) == 1
    assert default_chunk_tokens(64, 5) == 1


def test_default_tile_holds_no_more_than_256_mib_of_logits_nor_an_eighth_of_the_shard():
    from del_megatron.kernels.linear import default_tile_columns

    assert default_tile_columns(151936, 4096) == 16384  # 256 MiB of fp32 logits
    assert default_tile_columns(151936 // 2, 4096) == 9496  # TP 2: an eighth of the shard
    assert default_tile_columns(PADDED_VOCAB_SIZE, 69) == 8
    assert default_tile_columns(5, 10**9) == 1


V = 151936


@pytest.mark.parametrize(
    "tokens, local_vocab, hidden_size, dtype, route",
    [
        (4096, V, 512, torch.bfloat16, "forward"),  # 6 V h bytes = 3/16 of 4 N V: the bound
        (4096, V, 513, torch.bfloat16, "backward"),
        (4096, V, 1024, torch.bfloat16, "backward"),
        (4096, V // 2, 1024, torch.bfloat16, "backward"),
        (16384, V, 2048, torch.bfloat16, "forward"),
        (4096, V, 1024, torch.float16, "backward"),
        (4096, V, 8192, torch.float32, "forward"),  # the accumulator is the gradient
        (4096, V, 8192, torch.float64, "forward"),
        (8192, 128256, 4096, torch.bfloat16, "backward"),  # a 7B model, micro-batch 1 x 8192
        # TP 8, h 8192, 32768 tokens: the backward route's fp32 [N, h] would be larger
        (32768, V // 8, 8192, torch.bfloat16, "forward"),
    ],
)
def test_auto_weight_gradient_route_holds_the_smaller_buffers(
    tokens, local_vocab, hidden_size, dtype, route
):
    from del_megatron.kernels.linear import resolve_weight_gradient

    assert resolve_weight_gradient("auto", tokens, local_vocab, hidden_size, dtype) == route
    for forced in ("forward", "backward"):
        assert resolve_weight_gradient(forced, tokens, local_vocab, hidden_size, dtype) == forced
