"""NeMo 2.7.0 with DEL, against NeMo's real code on CPU (Python 3.12 environment,
tests/requirements-bridge.txt): `nemo.lightning.megatron_parallel.MaskedTokenLossReduction`,
subclassed by numerical_loss_reduction, on two micro-batches of a tiny Megatron-Core GPTModel
with the loss hook. forward keeps NeMo 2.7.0's three return values and reduce its loss, with
the DEL telemetry summed over micro-batches and logged through reduce; values against
del_megatron.reference on the same logits. One worker process (tests/bridge_workers/)."""

import pytest

from .test_bridge import ALPHA, run_check


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    return run_check("nemo", tmp_path_factory.mktemp("nemo"))


def test_forward_keeps_the_three_value_contract(nemo):
    assert nemo["forward_len"] == 3
    assert "loss_sum_and_ub_size" in nemo["forward_keys"]
    assert {"del/ce loss", "del/del term", "del/digit acc"} <= set(nemo["forward_keys"])


def test_reduce_gives_nemos_loss_of_ce_plus_alpha_term(nemo):
    assert nemo["loss"] == pytest.approx(nemo["ref_loss"], rel=1e-6)
    # NeMo's own reduce on the same micro-batch outputs gives the same loss.
    assert nemo["plain_reduce"] == pytest.approx(nemo["loss"], rel=1e-7)
    assert ALPHA == 0.5


def test_reduce_logs_the_telemetry(nemo):
    ref = nemo["ref_telemetry"]
    telemetry = nemo["telemetry"]
    for name in ("ce loss", "del term", "digit share"):
        assert telemetry[name] == pytest.approx(ref[name], rel=1e-6)
    assert 0.0 <= telemetry["digit acc"] <= 1.0
    assert dict(nemo["logged"]) == pytest.approx(telemetry)


def test_enable_numerical_loss_sets_both_reductions_and_the_config(nemo):
    enabled = nemo["enabled"]
    assert enabled["training"] == "NumericalMaskedTokenLossReduction"
    assert enabled["validation_step"] is True and enabled["val_prefix"] == "val "
    assert enabled["config_loss"] == "del" and enabled["config_digits"] == list(range(40, 50))
    assert nemo["control"] == {"loss": "digit_ce", "alpha": 0.38}  # the digit_ce control arm


def test_enable_numerical_loss_reads_a_chunking_tokenizer_from_the_model(nemo):
    """NeMo's AutoTokenizer on the real Llama-3.2 tokenizer folder, as model.tokenizer: the
    config gets the ids of the file's own vocab, the 1,100 multi-digit ones included."""
    from .test_tokenizers import LLAMA3_TOKENIZER, ids_in_tokenizer_json

    r, expected = nemo["chunking"], ids_in_tokenizer_json(LLAMA3_TOKENIZER)
    assert r["tokenizer_class"] == "AutoTokenizer" and r["chunked"] is True
    assert r["text_to_ids_12"][-1] == expected["multi_digit_ids"][12]
    assert r["slot_logits"] == "length"
    assert r["config"] == {
        "del_digit_token_ids": list(expected["digit_ids"]),
        "del_decimal_point_token_ids": list(expected["decimal_point_ids"]),
        "del_multi_digit_token_ids": list(expected["multi_digit_ids"]),
    }
