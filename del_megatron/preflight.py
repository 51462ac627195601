"""`del-megatron check`: what a run's tokenizer means for DEL, in seconds, before the job.

Given a tokenizer file (what DigitVocab.from_tokenizer reads), Megatron-LM's
`--tokenizer-type` / `--tokenizer-model` pair, or GPT2BPETokenizer's `--vocab-file` and
`--merge-file`, report the digit and decimal-point ids, whether numbers are split one digit per
token, the tokenizer's family with the DEL weight (alpha) recommended for it, and the
Megatron-LM flags to add. With Megatron-LM's `--data-path`, also
the share of the data's label positions that are digit targets (del_megatron.data_share), and
the flags of the token reduction that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .data_share import DEFAULT_SAMPLE_TOKENS, BlendShare, DatasetShare, blend_share
from .tokenizers import (
    QWEN_PATTERN,
    MultiDigitTokens,
    OffsetEncoding,
    load_gpt2_bpe,
    load_tokenizer,
    spaced_digit_tokens,
)
from .vocab import DigitVocab, digit_vocab_from_tokenizer

# `--del-alpha`'s default (del_megatron/megatron/args.py): the smaller of the DEL paper's two
# settings, for tokenizers the paper did not train with.
DEFAULT_ALPHA = 0.01


@dataclass(frozen=True)
class AlphaAdvice:
    """The DEL weight recommended for a tokenizer family, and where it comes from."""

    family: str
    alpha: float
    source: str


# docs/DEL.md: the DEL paper used alpha 0.1 in its CodeLlama and Mistral-7B-v0.1 runs
# (SentencePiece tokenizers that split digits) and 0.01 in its Qwen-2.5 and DeepSeek-Math runs
# (byte-level BPE); the authors' training scripts name those models.
SENTENCEPIECE = AlphaAdvice(
    "SentencePiece (Llama-2, CodeLlama, Mistral 7B style)",
    0.1,
    "the DEL paper's CodeLlama and Mistral-7B-v0.1 runs",
)
BYTE_LEVEL_BPE = AlphaAdvice(
    "byte-level BPE (Qwen-2.5, DeepSeek, Llama-3 style)",
    0.01,
    "the DEL paper's Qwen-2.5 and DeepSeek-Math runs; its Qwen script did not divide the term by "
    "its 32 gradient-accumulation steps, so the weight in effect there was about 0.32 "
    "(docs/DEL.md)",
)
TEKKEN = AlphaAdvice(
    "tekken (Mistral NeMo and later)",
    DEFAULT_ALPHA,
    "no paper run used this family (the paper's Mistral run is Mistral-7B-v0.1, SentencePiece): "
    "--del-alpha's default, the smaller paper setting",
)
UNKNOWN = AlphaAdvice(
    "not recognised",
    DEFAULT_ALPHA,
    "no paper run is known for it: --del-alpha's default, the smaller paper setting",
)


def alpha_advice(tok: Any) -> AlphaAdvice:
    """The family of a loaded tokenizer (load_tokenizer's result) and the weight for it."""
    if hasattr(tok, "piece_to_id"):
        return SENTENCEPIECE
    if isinstance(tok, OffsetEncoding):
        return TEKKEN
    if hasattr(tok, "encode_ordinary"):  # a .tiktoken rank file: Qwen's format
        return BYTE_LEVEL_BPE
    if hasattr(tok, "to_str"):  # Hugging Face tokenizer.json
        spec = tok.to_str()
        if "ByteLevel" in spec:
            return BYTE_LEVEL_BPE
        # '▁' (U+2581, raw or escaped) marks word starts in a SentencePiece model converted to
        # tokenizer.json (Llama-2's)
        if "Metaspace" in spec or "\u2581" in spec or "\\u2581" in spec:
            return SENTENCEPIECE
    return UNKNOWN


# docs/results.md, the chunked-tokenizer comparison.
CHUNKED_EVIDENCE = (
    "chunking tokenizers: no paper run used one; in our CPU comparison (docs/results.md, 5 "
    "seeds, weights in the papers' unit) no DEL variant beat plain CE in digit accuracy (DEL on "
    "single digits -0.010 [-0.023, +0.004], with slots 'length' -0.003 [-0.038, +0.031], 'any' "
    "-0.001 [-0.018, +0.016]) and no slot rule beat single digits. The flags below train DEL on "
    "the ten single-digit tokens (the default): A/B them against --numerical-loss ce, and "
    "against the same with --del-slot-logits length, before a long run"
)

# What --del-alpha means under either reduction (NumericalLossConfig.alpha).
WEIGHT_MEANING = (
    "alpha is the weight on the mean term over digit targets (the papers' unit): "
    "loss = mean CE + alpha x mean digit term"
)

# NTL-WAS and NTL-MSE at their authors' recommended 0.3; DIST2 has none of its own: DEL's.
OTHER_LOSS_WEIGHTS = {"ntl_was": 0.3, "ntl_mse": 0.3}


def recommended_weight(loss: str, advice: AlphaAdvice) -> float:
    """The weight `check` prints for `loss` with a tokenizer of `advice`'s family."""
    return OTHER_LOSS_WEIGHTS.get(loss, advice.alpha)


# Megatron-LM --tokenizer-type values whose --tokenizer-model is a file load_tokenizer reads.
MEGATRON_TOKENIZER_TYPES = {
    "SentencePieceTokenizer": "a SentencePiece .model",
    "GPTSentencePieceTokenizer": "a SentencePiece .model",
    "Llama2Tokenizer": "a SentencePiece .model",
    "TikTokenizer": "a .tiktoken rank file or a tekken JSON",
    "HuggingFaceTokenizer": "a folder with tokenizer.json (or the file)",
}
# The --tokenizer-type that reads GPT-2's vocab.json and merges.txt (--vocab-file, --merge-file).
GPT2_BPE = "GPT2BPETokenizer"
NO_TEXT_TYPES = ("NullTokenizer", "NullMultimodalTokenizer")


@dataclass
class Preflight:
    """The outcome of a check: ids found (None when the tokenizer cannot serve DEL), whether
    numbers split as DEL needs without the multi-digit opt-in (one digit a token, or chunks),
    and what to tell the user."""

    digit_ids: Optional[List[int]]
    decimal_point_ids: List[int]
    digits_split: bool
    message: str
    advice: AlphaAdvice = UNKNOWN
    chunked: bool = False
    vocab: Optional[DigitVocab] = None

    @property
    def ok(self) -> bool:
        return self.digit_ids is not None

    def flags(
        self, loss: str = "del", alpha: Optional[float] = None, digit_share: Optional[float] = None
    ) -> str:
        """The Megatron-LM flags; alpha None: the one recommended for the family. digit_share
        None: the digit reduction; else the token reduction with that share (3 digits)."""
        if not self.ok:
            return ""
        alpha = recommended_weight(loss, self.advice) if alpha is None else alpha
        flags = [f"--numerical-loss {loss} --del-alpha {alpha:g}"]
        if not self.chunked:  # a chunking run reads its 1,110 number tokens from its tokenizer
            flags.append("--del-digit-token-ids " + " ".join(map(str, self.digit_ids)))
            if self.decimal_point_ids:
                points = " ".join(map(str, self.decimal_point_ids))
                flags.append(f"--del-decimal-point-token-ids {points}")
        if digit_share is None:
            flags.append("--del-reduction digit")
        else:
            flags.append(f"--del-reduction token --del-digit-share {digit_share:.3g}")
        if not self.digits_split:
            flags.append("--del-allow-multi-digit-tokens")
        return " ".join(flags)


def _unknown_type(tokenizer_type: str) -> ValueError:
    known = ", ".join(sorted([*MEGATRON_TOKENIZER_TYPES, GPT2_BPE]) + list(NO_TEXT_TYPES))
    return ValueError(f"--tokenizer-type {tokenizer_type!r}: this check reads {known}")


def _load(
    path: Optional[str],
    tokenizer_type: Optional[str],
    vocab_file: Optional[str],
    merge_file: Optional[str],
    tiktoken_pattern: str,
) -> Tuple[Any, str]:
    """(the tokenizer, how to name it) from Megatron-LM's tokenizer flags."""
    gpt2_files = vocab_file is not None or merge_file is not None
    if tokenizer_type == GPT2_BPE or (tokenizer_type is None and gpt2_files):
        if path is not None:
            raise ValueError(
                f"{GPT2_BPE} reads --vocab-file and --merge-file, not --tokenizer-model: drop "
                f"--tokenizer-model {path}"
            )
        if vocab_file is None or merge_file is None:
            raise ValueError(
                f"{GPT2_BPE} needs both --vocab-file (its vocab.json) and --merge-file (its "
                "merges.txt)"
            )
        return load_gpt2_bpe(vocab_file, merge_file), f"{vocab_file} + {merge_file}"
    if tokenizer_type is not None and tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        raise _unknown_type(tokenizer_type)
    if gpt2_files:
        raise ValueError(
            f"--vocab-file and --merge-file are {GPT2_BPE}'s files; --tokenizer-type "
            f"{tokenizer_type} reads --tokenizer-model only: drop them, or pass --tokenizer-type "
            f"{GPT2_BPE}"
        )
    if path is None:
        raise ValueError("give the tokenizer file (--tokenizer / --tokenizer-model)")
    return load_tokenizer(path, tiktoken_pattern), path


def _spaced_note(tok: Any) -> str:
    spaced = spaced_digit_tokens(tok)
    if not spaced:
        return ""
    shown = ", ".join(repr(t) for _, t in spaced[:4])
    return f"; its tokens for a digit after a space ({shown}) are no digit targets"


def check_tokenizer(
    path: Optional[str],
    tokenizer_type: Optional[str] = None,
    allow_multi_digit_tokens: bool = False,
    tiktoken_pattern: str = QWEN_PATTERN,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> Preflight:
    """Check the tokenizer at `path` (Megatron-LM's --tokenizer-model when tokenizer_type, its
    --tokenizer-type, is given), or GPT2BPETokenizer's vocab_file and merge_file (--vocab-file,
    --merge-file). Files that do not exist or cannot be read raise."""
    if tokenizer_type in NO_TEXT_TYPES:
        return Preflight(
            None,
            [],
            False,
            f"{tokenizer_type} has no text, so no digit tokens can be found in it: pass "
            "--del-digit-token-ids with the ids your data uses for '0'..'9' "
            "(and --del-decimal-point-token-ids for '.')",
        )
    tok, name = _load(path, tokenizer_type, vocab_file, merge_file, tiktoken_pattern)
    try:
        vocab = digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens=False)
        how, split = "one digit per token", True
    except MultiDigitTokens as refused:
        if not allow_multi_digit_tokens:
            return Preflight(None, [], False, str(refused))
        try:
            vocab = digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens=True)
        except ValueError as still_refused:
            return Preflight(None, [], False, str(still_refused))
        how, split = f"{refused.how} (DEL: single-digit tokens only)", False
    except ValueError as refused:
        return Preflight(None, [], False, str(refused))
    if vocab.chunked:
        how = (
            "in chunks of up to three digits, left to right, with all 1,110 number tokens "
            "(a chunking tokenizer: DEL on its ten single-digit tokens; --del-slot-logits "
            "gives every digit of its multi-digit tokens a term too)"
        )
    if not split:
        how += _spaced_note(tok)
    return Preflight(
        list(vocab.digit_ids),
        list(vocab.decimal_point_ids),
        split,
        f"{name}: numbers tokenize {how}",
        alpha_advice(tok),
        vocab.chunked,
        vocab,
    )


def measure_data(
    result: Preflight, data_path: Sequence[str], sample_tokens: int = DEFAULT_SAMPLE_TOKENS
) -> BlendShare:
    """The digit share of Megatron-LM's --data-path list, counted with the checked tokenizer's
    number tokens; ValueError when it has none DEL can use."""
    if not result.ok:
        raise ValueError(
            "--data-path: counting digit targets needs a tokenizer with digit ids, and this one "
            f"has none DEL can use: {result.message}"
        )
    return blend_share(data_path, result.vocab, sample_tokens)


def _read(d: DatasetShare) -> str:
    return (
        f"{d.read_tokens:,} tokens in {d.read_documents:,} of {d.documents:,} documents of "
        f"{d.prefix}"
    )


def _what_was_read(data: BlendShare) -> str:
    if len(data.datasets) == 1:
        return _read(data.datasets[0])
    how = "weights normalised"
    if not data.weighted:
        how = "weighed by their tokens, as Megatron blends prefixes without weights"
    parts = [
        f"weight {w:.3g}, share {d.share:.4g}: {_read(d)}"
        for w, d in zip(data.weights, data.datasets, strict=True)
    ]
    return f"the mean over {len(parts)} datasets, {how}; " + "; ".join(parts)


def share_lines(
    result: Preflight, data: BlendShare, loss: str = "del", alpha: Optional[float] = None
) -> List[str]:
    """The measured digit share (how much was read, from which datasets) and the flags of the
    token reduction that uses it."""
    share = data.share
    lines = [
        f"digit share of --data-path: {share:.4g} of label positions are digit targets, counted "
        f"in digits ({_what_was_read(data)})"
    ]
    if not 0 < float(f"{share:.3g}") <= 1:
        lines.append(
            f"no token route for a share of {share:.3g} (--del-digit-share takes (0, 1]): keep "
            "the digit reduction above"
        )
        return lines
    lines.append(
        "or the token route, exact while the batches keep this share (each digit token's term "
        f"weighs alpha / S, no counting): {result.flags(loss, alpha, share)}"
    )
    return lines


def report(
    result: Preflight,
    loss: str = "del",
    alpha: Optional[float] = None,
    data: Optional[BlendShare] = None,
) -> str:
    """The lines `del-megatron check` prints; alpha None: the family's recommended weight;
    data: the --data-path's measured share (measure_data), for the token-route flags."""
    lines = [result.message]
    if result.ok:
        advice = result.advice
        lines.append(f"digit ids ('0'..'9'): {' '.join(map(str, result.digit_ids))}")
        points = " ".join(map(str, result.decimal_point_ids)) or "none found"
        lines.append(f"decimal-point ids: {points}")
        if result.chunked:
            lines.append(
                "number tokens: 1,110 ('0'..'9', '00'..'99', '000'..'999'); the run reads them "
                "from its --tokenizer-model, so the flags below name no ids"
            )
        lines.append(f"tokenizer family: {advice.family}")
        yours = "" if alpha is None else f" (the flags below use your --alpha {alpha:g})"
        if loss in OTHER_LOSS_WEIGHTS:
            why = f"{loss}'s authors' recommendation"
        else:
            why = advice.source if loss == "del" else f"DEL's: {advice.source}"
        weight = recommended_weight(loss, advice)
        lines.append(f"recommended --del-alpha {weight:g} for {loss}: {why}{yours}")
        if result.chunked:
            lines.append(CHUNKED_EVIDENCE)
        lines.append(WEIGHT_MEANING)
        lines.append(f"add to pretrain_gpt.py: {result.flags(loss, alpha)}")
        if data is not None:
            lines += share_lines(result, data, loss, alpha)
    return "\n".join(lines)
