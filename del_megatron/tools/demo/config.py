"""The demo's training settings: one dataclass that the CLI turns into flags, with the range
each numeric setting must lie in (checked by argparse before anything launches, and by the
dataclass itself when it is made in Python)."""

from __future__ import annotations

import numbers
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, List, Mapping, Optional, Sequence

from ...config import check_learning_rate, check_weight
from ...digits.slots import DEFAULT_SLOT_LOGITS
from ..preflight import SENTENCEPIECE

# `--tokenizer chunked`: prepare trains a byte-level BPE that cuts numbers into chunks of up to
# three digits, with Llama-3's pre-tokenizer (text_tokenizer.train_chunking_bpe).
CHUNKED = "chunked"
# The `del_single` loss: DEL on the ten single-digit tokens only (DigitVocab.single_digits_only),
# what a chunking tokenizer got before DEL had slots; the same as `del` on a one-digit tokenizer.
SINGLE_DIGIT_DEL = "del_single"

# The demo's reduction, which makes alpha the weight on the mean term over digit targets.
WEIGHT_REDUCTION = "digit"

# Ranges of numeric settings: "positive" (> 0) or "non-negative" (>= 0).
POSITIVE, NON_NEGATIVE = "positive", "non-negative"


def _final_rate(value: Any, name: str) -> float:
    return check_learning_rate(value, name, allow_zero=True)


def _setting(default, bound: str, help: str = "", rule: Optional[Callable] = None):
    """A numeric setting: an int within `bound`, or a float checked by `rule(value, name)`
    (del_megatron.config: a weight, a learning rate)."""
    return field(default=default, metadata={"bound": bound, "help": help, "rule": rule})


def _count(value: Any, name: str, bound: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < 0 or (bound == POSITIVE and value == 0):
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def check_setting(f: Field, value: Any) -> Any:
    """`value` for the TrainConfig setting `f`, if it lies in the setting's range; else
    ValueError (TypeError for a value of the wrong kind) naming the setting."""
    rule = f.metadata["rule"]
    return rule(value, f.name) if rule is not None else _count(value, f.name, f.metadata["bound"])


def check_out_dir(path: str) -> str:
    """`path` if a folder can be made or used there; ValueError naming the file in the way."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is" if existing == os.path.abspath(path) else f"lies in {existing!r}, which is"
        raise ValueError(
            f"output folder {path!r} {what} a file, not a folder: name a new or existing folder"
        )
    return path


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str
    loss: str = "del"
    # `del-megatron check`'s recommendation for the demo's tokenizer (a digit-splitting
    # SentencePiece model): the DEL paper's weight in its CodeLlama and Mistral runs
    alpha: float = _setting(
        SENTENCEPIECE.alpha,
        NON_NEGATIVE,
        "weight of the numerical term (`del-megatron check --tokenizer T` recommends one for "
        "a tokenizer T you bring)",
        check_weight,
    )
    steps: int = _setting(1500, POSITIVE, "optimizer steps")
    micro_batch: int = _setting(16, POSITIVE, "sequences a step")
    seq_len: int = _setting(64, POSITIVE, "tokens a sequence")
    hidden: int = _setting(192, POSITIVE, "hidden size (a multiple of --heads)")
    layers: int = _setting(3, POSITIVE, "transformer layers")
    heads: int = _setting(6, POSITIVE, "attention heads (a multiple of the TP size)")
    lr: float = _setting(2e-3, POSITIVE, "peak learning rate", check_learning_rate)
    min_lr: float = _setting(
        2e-4, NON_NEGATIVE, "final learning rate of the cosine decay", _final_rate
    )
    warmup: int = _setting(50, NON_NEGATIVE, "warm-up steps (capped at steps / 5)")
    seed: int = _setting(1234, NON_NEGATIVE, "random seed")
    save_interval: int = _setting(250, POSITIVE, "steps between checkpoints")
    resume: bool = False
    stop_after: int = _setting(0, NON_NEGATIVE, "stop as if killed after this step (0: never)")
    eval_problems: int = _setting(
        0, NON_NEGATIVE, "held-out problems scored at the end of the run (0: all)"
    )
    curve_points: int = _setting(
        10, NON_NEGATIVE, "evenly spaced steps at which the learning curve is scored (0: none)"
    )
    curve_problems: int = _setting(
        200, NON_NEGATIVE, "held-out problems (the first N) scored at each curve point (0: all)"
    )
    progress: bool = True
    # alpha's unit: the weight on the mean term over digit targets (NumericalLossConfig's
    # "digit" reduction). Runs made before it was recorded trained alpha x the batch's digit
    # share on that mean (the old "token" reduction): LEGACY_SETTINGS.
    reduction: str = WEIGHT_REDUCTION
    # A chunking tokenizer's slot rule (NumericalLossConfig.slot_logits; `--slot-logits`).
    slot_logits: str = DEFAULT_SLOT_LOGITS
    # Continued pretraining: the checkpoints folder of the run whose weights this one starts
    # from (its optimizer and schedule start afresh); "" trains from random weights.
    init_from: str = ""
    # A prepared data folder whose held-out problems' whole texts are scored for CE at the end
    # (`base_ce`: what continued pretraining costs on the base distribution); "" for none.
    base_data_dir: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if "bound" in f.metadata:
                setattr(self, f.name, check_setting(f, getattr(self, f.name)))
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr:g} must not exceed lr {self.lr:g}")


# Fields that are not flags of their own (the CLI sets them by other means).
NOT_FLAGS = (
    "data_dir",
    "out_dir",
    "loss",
    "resume",
    "progress",
    "reduction",
    "slot_logits",
    "init_from",
    "base_data_dir",
)
# What a saved run that lacks a setting trained with (it was made before the setting existed).
LEGACY_SETTINGS = {"reduction": "token", "slot_logits": "any"}
# Losses on which the slot rule has no effect: compare does not tell their runs apart by it.
NO_SLOTS = ("ce", SINGLE_DIGIT_DEL)

# Continued pretraining (`compare --continue-from-base`, the demo): the base trains BASE_STEPS
# with the settings' defaults; every arm then continues it with these, a continued-pretraining
# schedule (half the base's peak rate, a short warm-up), unless flags say otherwise.
BASE_STEPS = 1000
CONTINUED_SETTINGS = {"steps": 400, "lr": 1e-3, "min_lr": 1e-4, "warmup": 20}

# Fields that do not change what a run trains: where it lives, how it is driven, how much of the
# held-out set it is scored on and when (scoring draws no random numbers: the weights are the
# same). A checkpoint resumes across them; `compare` reuses a run only if it was scored alike.
SCORING = ("eval_problems", "curve_points", "curve_problems", "base_data_dir")
NOT_DEFINING = (
    "data_dir",
    "out_dir",
    "resume",
    "progress",
    "stop_after",
    "save_interval",
    *SCORING,
)


def differing_settings(
    saved: Mapping[str, object],
    wanted: Mapping[str, object],
    ignore: Sequence[str] = NOT_DEFINING,
) -> List[str]:
    """'name saved -> wanted' for each setting in `wanted` (but `ignore`) that a saved run (the
    config in its metrics.json or checkpoint) has otherwise. Settings it lacks are skipped,
    except those of LEGACY_SETTINGS, which it trained with."""
    saved = {**LEGACY_SETTINGS, **saved} if saved else saved
    return [
        f"{name} {saved[name]!r} -> {value!r}"
        for name, value in wanted.items()
        if name not in ignore and name in saved and saved[name] != value
    ]
