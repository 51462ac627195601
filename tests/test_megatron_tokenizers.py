"""Megatron's own tokenizer wrappers with a chunking tokenizer: Megatron-Core's MegatronTokenizer
and Megatron-LM's --tokenizer-type HuggingFaceTokenizer, with the real Llama-3.2 file.

Both are transformers' AutoTokenizer, pinned in the Python 3.12 environment only
(tests/requirements-py312.txt): tests/conftest.py collects this file there."""

from types import SimpleNamespace

import pytest

import del_megatron as dm

from .test_tokenizers import LLAMA3_TOKENIZER, assert_ids_of_the_file, ids_in_tokenizer_json


@pytest.fixture(scope="module")
def megatron_llama3():
    """Llama-3.2's tokenizer as Megatron-Core's MegatronTokenizer builds it for the
    "huggingface" library (transformers' AutoTokenizer, special tokens included)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(LLAMA3_TOKENIZER.parent), metadata_path={"library": "huggingface"}
    )


def test_megatron_core_hugging_face_tokenizer_with_llama3(megatron_llama3):
    """Its tokenize() puts <|begin_of_text|> before every text; from_tokenizer still reads the
    chunking tokenizer's ids, those of the file."""
    tok = megatron_llama3
    twelve = ids_in_tokenizer_json(LLAMA3_TOKENIZER)["multi_digit_ids"][12]
    assert tok.tokenize("12") == [tok.bos, twelve]
    assert_ids_of_the_file(dm.DigitVocab.from_tokenizer(tok), LLAMA3_TOKENIZER)


def test_megatron_lms_build_tokenizer_hugging_face_tokenizer_with_llama3():
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model <folder>, through the functions
    the drop-in and the patch call (Megatron-Core's build_tokenizer, as pretrain_gpt.py at
    core_v0.19.0 imports it, then digit_vocab_from_args)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from del_megatron.megatron.flags import digit_vocab_from_args

    args = SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(LLAMA3_TOKENIZER.parent),
        chat_template=None, vocab_file=None, merge_file=None, special_tokens=None,
        tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, metadata_path=None, pad_vocab_size=True,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, rank=0,
        numerical_loss="del", del_digit_token_ids=None, del_decimal_point_token_ids=None,
        del_allow_multi_digit_tokens=False, del_single_digits_only=False,
        del_slot_logits="length",
    )  # fmt: skip
    tok = build_tokenizer(args)
    assert args.padded_vocab_size == 128512  # 128,257 ids padded to a multiple of 256
    vocab = digit_vocab_from_args(args, tok)
    assert_ids_of_the_file(vocab, LLAMA3_TOKENIZER)
    vocab.check_vocab_size(args.padded_vocab_size)
    args.del_slot_logits = None  # without a slot rule: the single-digit tokens
    assert digit_vocab_from_args(args, tok) == vocab.single_digits_only()


def test_check_gives_the_ids_and_split_of_megatrons_hugging_face_class(megatron_llama3, capsys):
    """`check --tokenizer-type HuggingFaceTokenizer` on the folder: Megatron's class's ids, in
    chunks; the single digits are what the printed flags train."""
    from .test_check_types import check, ids_line

    code, out, _ = check(
        capsys, "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(LLAMA3_TOKENIZER.parent),
    )  # fmt: skip
    theirs = dm.DigitVocab.from_tokenizer(megatron_llama3)
    assert code == 0 and theirs.chunked and "in chunks of up to three digits" in out
    assert ids_line(out) == list(theirs.digit_ids)


def test_check_reads_gpt2_files_as_gpt2_reads_them(tmp_path, capsys):
    """Megatron-Core 0.19's GPT2BPETokenizer is transformers' GPT-2 tokenizer over --vocab-file
    and --merge-file (built from the Hugging Face hub's 'gpt2' name, which CI cannot reach):
    check's reading of the same files encodes as transformers' GPT2TokenizerFast."""
    from transformers import GPT2TokenizerFast

    from del_megatron.digits.tokenizers import load_gpt2_bpe

    from .test_tokenizers import gpt2_bpe_files

    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    theirs = GPT2TokenizerFast.from_pretrained(str(tmp_path))  # the folder with both files
    ours = load_gpt2_bpe(vocab_file, merge_file)
    for text in ("x = 42.5, 1234567 and pi 3.14159\n", "10123456789", " 7 apples"):
        assert ours.encode(text).ids == theirs(text)["input_ids"]
