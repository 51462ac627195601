"""Trains a small SentencePiece model that keeps one digit per token (Llama-2 style), for the
wheel stage's `del-megatron check` (tests/wheel/run.sh): python sentencepiece_model.py OUT.model.

Self-contained on purpose: it runs in the wheel's fresh environment, where the checkout (and so
tests/sentencepiece_models.py) is not importable.
"""

import random
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm


def main(out: Path) -> None:
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(200)
    ]
    lines = [
        f"{rng.choice(words)} {rng.randint(0, 999)} {rng.choice(words)} "
        f"{rng.randint(1, 99)}.{rng.randint(0, 99):02d} {rng.choice(words)}"
        for _ in range(2000)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(lines) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "m"), vocab_size=300,
            split_digits=True, model_type="bpe", hard_vocab_limit=False, minloglevel=2,
        )  # fmt: skip
        out.write_bytes((Path(tmp) / "m.model").read_bytes())
    print(f"trained {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
