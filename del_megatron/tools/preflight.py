"""`del-megatron check`: what a run's tokenizer means for DEL, in seconds, before the job.

Given a tokenizer file (what DigitVocab.from_tokenizer reads), Megatron-LM's
`--tokenizer-type` / `--tokenizer-model` pair, or GPT2BPETokenizer's `--vocab-file` and
`--merge-file`, report the digit and decimal-point ids, whether numbers are split one digit per
token, the tokenizer's family with the DEL weight (alpha) recommended for it, and the
Megatron-LM flags to add. With Megatron-LM's `--data-path`, also
the share of the data's label positions that are digit targets (del_megatron.digits.data_share), and
the flags of the token reduction that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ..config import DEFAULT_ALPHA
from ..digits.data_share import DEFAULT_SAMPLE_TOKENS, BlendShare, DatasetShare, blend_share
from ..digits.tokenizer_types import NO_TEXT_TYPES, read_as_megatron
from ..digits.tokenizers import (
    MEGATRON_TIKTOKEN_PATTERNS,
    QWEN_RANKS,
    MultiDigitTokens,
    OffsetEncoding,
    spaced_digit_tokens,
)
from ..digits.vocab import DigitVocab, digit_vocab_from_tokenizer


@dataclass(frozen=True)
class AlphaAdvice:
    """The DEL weight recommended for a tokenizer family, and where it comes from."""

    family: str
    alpha: float
    source: str


# The weights the DEL paper's runs applied to the mean term over digit targets (docs/DEL.md,
# "The weight the paper's runs applied"; tests/test_paper_weights.py replays the arithmetic).
SENTENCEPIECE = AlphaAdvice(
    "SentencePiece (Llama-2, CodeLlama, Mistral 7B style)",
    0.1,
    "the weight the DEL paper's CodeLlama and Mistral-7B-v0.1 runs applied (their script wrote "
    "0.1 and transformers 4.35.2 divided the loss by its accumulation steps)",
)
QWEN = AlphaAdvice(
    "Qwen (Qwen-2.5 style byte-level BPE, one digit a token)",
    1.28,
    "the weight the DEL paper's Qwen2.5 run applied: its script wrote 0.01 on each "
    "micro-batch's mean term, and transformers 4.57.1 neither divided it by the 32 accumulation "
    "steps nor undid its x 4 for 4 processes (0.01 x 32 x 4, docs/DEL.md)",
)
DEEPSEEK = AlphaAdvice(
    "DeepSeek LLM / Math (byte-level BPE, one digit a token)",
    2.56,
    "the weight the DEL paper's DeepSeek-Math run applied: its script wrote 0.01 on each "
    "micro-batch's mean term, and transformers 4.57.1 neither divided it by the 32 accumulation "
    "steps nor undid its x 8 for 8 processes (0.01 x 32 x 8, docs/DEL.md)",
)
_NO_RUN = (
    f"no paper run used this family: --del-alpha's default {DEFAULT_ALPHA:g}, the weight the "
    "DEL paper's CodeLlama and Mistral runs applied"
)
CHUNKING = AlphaAdvice(
    "chunking (Llama-3, cl100k / o200k, DeepSeek-V3 style: numbers in chunks of up to three)",
    DEFAULT_ALPHA,
    _NO_RUN,
)
TEKKEN = AlphaAdvice(
    "tekken's split (Mistral NeMo and later; NVIDIA's Nemotron-H and Nemotron-Nano-v2 tokenizer, "
    "Megatron-LM's TikTokenizer pattern v2), one digit a token",
    DEFAULT_ALPHA,
    _NO_RUN,
)
BYTE_LEVEL_BPE = AlphaAdvice("byte-level BPE, one digit a token", DEFAULT_ALPHA, _NO_RUN)
UNKNOWN = AlphaAdvice("not recognised", DEFAULT_ALPHA, _NO_RUN)
# Mistral's tekken split, which Megatron-LM's TikTokenizer takes as pattern v2 and NVIDIA's
# Nemotron-H tokenizer uses: one digit a token.
TEKKEN_PATTERN = MEGATRON_TIKTOKEN_PATTERNS["v2"]
# Added tokens that name a byte-level BPE's family (Qwen's chat markers, DeepSeek's BOS).
QWEN_MARKERS = ("<|im_start|>",)
DEEPSEEK_MARKERS = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>",)


def _added_tokens(tok: Any) -> List[str]:
    get = getattr(tok, "get_added_tokens_decoder", None)
    return [t.content for t in get().values()] if callable(get) else []


def _split_patterns(spec: str) -> List[str]:
    """The Split regexes of a tokenizer.json's pre-tokenizer (nested in Sequences)."""
    import json

    found: List[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if node.get("type") == "Split" and isinstance(pattern, dict) and "Regex" in pattern:
                found.append(pattern["Regex"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(spec).get("pre_tokenizer"))
    return found


def alpha_advice(tok: Any, chunked: bool = False) -> AlphaAdvice:
    """The family of a loaded tokenizer (load_tokenizer's result) and the weight for it;
    chunked: it cuts numbers into chunks of up to three digits."""
    if chunked:
        return CHUNKING
    if hasattr(tok, "piece_to_id"):
        return SENTENCEPIECE
    if isinstance(tok, OffsetEncoding):
        return TEKKEN
    if hasattr(tok, "encode_ordinary"):  # a rank file read with Qwen's pattern, or Megatron's
        if getattr(tok, "_pat_str", None) == TEKKEN_PATTERN:
            return TEKKEN
        return QWEN if getattr(tok, "n_vocab", 0) == QWEN_RANKS else BYTE_LEVEL_BPE
    if hasattr(tok, "to_str"):  # Hugging Face tokenizer.json
        # tekken's split first: Nemotron 3 names its ids 10 and 11 <|im_start|> / <|im_end|>,
        # Qwen's chat markers
        if TEKKEN_PATTERN in _split_patterns(tok.to_str()):
            return TEKKEN
        added = _added_tokens(tok)
        if any(m in added for m in QWEN_MARKERS):
            return QWEN
        if any(m in added for m in DEEPSEEK_MARKERS):
            return DEEPSEEK
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
    slot_logits: Optional[str] = None
    vocab_size: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.digit_ids is not None

    @property
    def route_vocab(self) -> Optional[DigitVocab]:
        """The number tokens the printed flags train: a chunking tokenizer's ten single digits
        unless a slot rule is given (then all 1,110), else the vocab as read."""
        if self.vocab is not None and self.chunked and self.slot_logits is None:
            return self.vocab.single_digits_only()
        return self.vocab

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
        if self.slot_logits is not None:
            flags.append(f"--del-slot-logits {self.slot_logits}")
        if digit_share is None:
            flags.append("--del-reduction digit")
        else:
            flags.append(f"--del-reduction token --del-digit-share {digit_share:.3g}")
        if not self.digits_split:
            flags.append("--del-allow-multi-digit-tokens")
        return " ".join(flags)


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
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    slot_logits: Optional[str] = None,
    **megatron: Any,
) -> Preflight:
    """Check the tokenizer at `path` as Megatron-LM's --tokenizer-type reads it (its
    --tokenizer-model; by what the file holds when tokenizer_type is None), or GPT2BPETokenizer's
    vocab_file and merge_file. slot_logits: the run's --del-slot-logits (a chunking tokenizer's
    route). `megatron`: TikTokenizer's tiktoken_pattern, tiktoken_num_special_tokens and
    vocab_size. Files that do not exist, or are not what the type reads, raise."""
    if tokenizer_type in NO_TEXT_TYPES:
        return Preflight(
            None,
            [],
            False,
            f"{tokenizer_type} has no text, so no digit tokens can be found in it: pass "
            "--del-digit-token-ids with the ids your data uses for '0'..'9' "
            "(and --del-decimal-point-token-ids for '.')",
        )
    tok, name, vocab_size = read_as_megatron(
        tokenizer_type, path, vocab_file, merge_file, **megatron
    )
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
    if slot_logits is not None and not vocab.chunked:
        raise ValueError(
            f"--del-slot-logits {slot_logits} gives a chunking tokenizer's multi-digit tokens "
            f"their terms, and {name} has one digit a token: drop --del-slot-logits"
        )
    if vocab.chunked:
        route = (
            f"every digit of them, through slot logits under the {slot_logits!r} rule"
            if slot_logits
            else "its ten single-digit tokens; --del-slot-logits gives every digit of its "
            "multi-digit tokens a term too"
        )
        how = (
            "in chunks of up to three digits, left to right, with all 1,110 number tokens "
            f"(a chunking tokenizer: DEL on {route})"
        )
    if not split:
        how += _spaced_note(tok)
    return Preflight(
        list(vocab.digit_ids),
        list(vocab.decimal_point_ids),
        split,
        f"{name}: numbers tokenize {how}",
        alpha_advice(tok, vocab.chunked),
        vocab.chunked,
        vocab,
        slot_logits,
        vocab_size,
    )


# Read at least this many tokens without one digit target, with a tokenizer that has digits,
# and the data is taken for another tokenizer's.
NO_DIGITS_SAMPLE = 10_000


def measure_data(
    result: Preflight, data_path: Sequence[str], sample_tokens: int = DEFAULT_SAMPLE_TOKENS
) -> BlendShare:
    """The digit share of Megatron-LM's --data-path list, counted over the targets the printed
    flags train (a chunking tokenizer's single digits, or every digit with a slot rule).
    ValueError when the tokenizer has no digit ids, or the data cannot be its tokens (ids at or
    above its vocabulary size; no digit target in a large sample)."""
    if not result.ok:
        raise ValueError(
            "--data-path: counting digit targets needs a tokenizer with digit ids, and this one "
            f"has none DEL can use: {result.message}"
        )
    data = blend_share(data_path, result.route_vocab, sample_tokens)
    for d in data.datasets:
        if result.vocab_size is not None and d.max_id >= result.vocab_size:
            raise ValueError(
                f"--data-path {d.prefix!r} holds token id {d.max_id:,}, and the tokenizer has "
                f"{result.vocab_size:,} ids: the data was written by another tokenizer. Check "
                "the tokenizer that preprocess_data.py wrote it with"
            )
        if d.digits == 0 and d.read_tokens >= NO_DIGITS_SAMPLE:
            raise ValueError(
                f"--data-path {d.prefix!r}: no digit target in {d.read_tokens:,} tokens, though "
                "this tokenizer has digit tokens: the data was likely written by another "
                "tokenizer. Check the tokenizer that preprocess_data.py wrote it with"
            )
    return data


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
        lines.append(f"add to pretrain_gpt.py or pretrain_hybrid.py: {result.flags(loss, alpha)}")
        if data is not None:
            lines += share_lines(result, data, loss, alpha)
    return "\n".join(lines)
