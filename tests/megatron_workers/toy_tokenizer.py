"""A Megatron-style tokenizer of the toy GPT's vocabulary."""

from __future__ import annotations

from ..gpt_helpers import GPT_VOCAB


class _ToyDigitTokenizer:
    """Megatron-style tokenizer (tokenize/detokenize) of the helper's toy vocabulary."""

    def tokenize(self, text):
        ids = []
        for ch in text:
            if ch.isdigit():
                ids.append(GPT_VOCAB.digit_ids[int(ch)])
            elif ch == ".":
                ids.append(GPT_VOCAB.decimal_point_ids[0])
            else:
                ids.append(51 if ch == " " else 60 + ord(ch) % 20)
        return ids

    def detokenize(self, ids):
        table = {d: str(k) for k, d in enumerate(GPT_VOCAB.digit_ids)}
        table[GPT_VOCAB.decimal_point_ids[0]] = "."
        return "".join(table.get(i, " " if i == 51 else "x") for i in ids)
