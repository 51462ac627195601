"""One small interface over the tokenizers the demo can use, with an end-of-document id and the
`eod`/`pad` attributes that Megatron's GPTDataset reads."""

from __future__ import annotations

import os
from typing import List, Optional

from ...digits.tokenizers import load_tokenizer, token_codec

# Llama-3's pre-tokenizer: its `\p{N}{1,3}` cuts numbers into chunks of up to three digits,
# left to right.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# End-of-text tokens of Hugging Face tokenizers: Llama-3, Qwen / GPT-2 / SmolLM, Llama-2 and
# Mistral, DeepSeek.
END_OF_TEXT = (
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)


class TextTokenizer:
    """encode(text) -> ids, decode(ids) -> text, eod, pad, vocab_size."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.inner = load_tokenizer(path)
        self._encode, self._decode_one = token_codec(self.inner)
        end_of_text = self._end_of_text()
        if hasattr(self.inner, "eos_id") and self.inner.eos_id() >= 0:  # SentencePiece
            self.eod = self.inner.eos_id()
            self.vocab_size = self.inner.get_piece_size()
        elif end_of_text is not None:  # a real HF tokenizer: its own end of text
            self.eod = end_of_text
            self.vocab_size = self.inner.get_vocab_size()
        else:  # tiktoken, a BPE trained here: append an end-of-document id
            size = getattr(self.inner, "n_vocab", None)
            if size is None:
                size = self.inner.get_vocab_size()
            self.eod = size
            self.vocab_size = size + 1
        self.pad = self.eod
        # Megatron's datasets hash this into their cache names.
        self.unique_identifiers = {"class": "TextTokenizer", "path": self.path}

    def _end_of_text(self) -> Optional[int]:
        """The id of a Hugging Face tokenizer's end-of-text token (END_OF_TEXT), if it has one."""
        find = getattr(self.inner, "token_to_id", None)
        ids = [find(name) for name in END_OF_TEXT] if callable(find) else []
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> List[int]:
        return list(self._encode(text))

    def decode(self, ids: List[int]) -> str:
        if hasattr(self.inner, "decode_ids"):
            return self.inner.decode_ids([i for i in ids if i != self.eod])
        return "".join(self._decode_one(i) for i in ids if i != self.eod)


def train_sentencepiece(texts: List[str], out_prefix: str, vocab_size: int = 320) -> str:
    """A SentencePiece model that splits numbers into digits, trained on `texts`; its path."""
    import sentencepiece as spm

    corpus = out_prefix + ".train.txt"
    with open(corpus, "w", encoding="utf-8") as fh:
        fh.write("\n".join(texts))
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=out_prefix,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        split_digits=True,
        byte_fallback=True,
        model_type="bpe",
        num_threads=1,
        minloglevel=2,
    )
    os.remove(corpus)
    return out_prefix + ".model"


def train_chunking_bpe(texts: List[str], path: str, vocab_size: int = 1700) -> str:
    """A byte-level BPE with Llama-3's pre-tokenizer, trained on `texts` and on every number
    0..999 (leading zeros too) so that all 1,110 number tokens are learnt; written as a
    tokenizer.json at `path`, which is returned."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    numbers = [f"{i:03d} {i:02d} {i}" for i in range(1000)] + [f"{i:02d}" for i in range(100)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(numbers * 3 + list(texts), trainer)
    tok.save(path)
    return path
