"""`del-megatron`: check a tokenizer for DEL, prepare a number-rich Megatron dataset, run the
CPU demo (CE vs DEL) and the comparisons:

    del-megatron check --tokenizer tok.model     # digit ids, the alpha for it, the flags to add
    del-megatron prepare --out data/             # synthetic corpus, trained SentencePiece
    del-megatron demo --out runs/demo            # a CE base, CE and DEL continued from it (TP=2)
    del-megatron compare --out runs/compare      # every loss x 5 seeds, 95% intervals
    del-megatron compare --continue-from-base    # the same, continued from a CE base per seed

(`python -m del_megatron` runs it too.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings
from dataclasses import Field, fields
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from ..config import check_weight
from ..cpu.ports import free_port
from ..cpu.quick_exit import skip_final_collections
from ..digits.slots import RULES
from ..loss import LOSSES
from .demo.config import (
    BASE_STEPS,
    CHUNKED,
    CONTINUED_SETTINGS,
    DEFAULT_SLOT_LOGITS,
    NON_NEGATIVE,
    NOT_FLAGS,
    POSITIVE,
    SINGLE_DIGIT_DEL,
    TrainConfig,
    check_out_dir,
    check_setting,
)

# What the demo trains: every loss, and DEL on single-digit tokens only (for chunking tokenizers).
DEMO_LOSSES = LOSSES + (SINGLE_DIGIT_DEL,)

# Everything that trains or prepares data (torch.distributed, Megatron-Core, the demo) is
# imported inside the command that needs it: `del-megatron --help` and bad arguments stay fast.


def _parsed(kind: Callable, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None


def _number(kind: Callable, bound: str) -> Callable[[str], object]:
    """argparse type: an int that is positive (> 0) or non-negative (>= 0)."""

    def parse(text: str):
        value = _parsed(kind, text)
        if value < 0 or (bound == POSITIVE and value == 0):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = f"{bound} {kind.__name__}"
    return parse


def _ruled(kind: Callable, rule: Callable[[object, str], object], name: str) -> Callable:
    """argparse type: a number that `rule(value, name)` accepts (del_megatron.config's range checks,
    TrainConfig's ranges); its refusal, less the leading name, is the one-line error."""

    def parse(text: str):
        value = _parsed(kind, text)
        try:
            return rule(value, name)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None

    parse.__name__ = f"{name} {kind.__name__}"
    return parse


def _setting_type(f: Field, kind: Callable) -> Callable:
    """argparse type of the TrainConfig setting `f`: the range TrainConfig itself checks."""
    return _ruled(kind, lambda value, _: check_setting(f, value), f.name)


def _out_dir(text: str) -> str:
    """argparse type: a folder to write into (new or existing), not a file."""
    try:
        return check_out_dir(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _existing(what: str, want_file: bool, keyword: Optional[str] = None) -> Callable[[str], str]:
    """argparse type: a path that exists (a file, with want_file), or `keyword` itself."""

    def parse(text: str) -> str:
        if keyword is not None and text == keyword:
            return text
        if not os.path.exists(text):
            raise argparse.ArgumentTypeError(f"{what} {text!r} does not exist")
        if want_file and not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not a file")
        return text

    return parse


def _arm(text: str):
    """argparse type: LOSS or LOSS@WEIGHT (del_megatron.tools.demo.compare.Arm)."""
    from .demo.compare import parse_arm

    try:
        return parse_arm(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _settings(args, skip: Sequence[str] = (), **override) -> Dict[str, object]:
    """The demo's training settings (TrainConfig fields that are flags, but `skip`) from the
    arguments, `override` replacing some by name."""
    return {
        f.name: override.get(f.name, getattr(args, f.name))
        for f in fields(TrainConfig)
        if f.name not in NOT_FLAGS and f.name not in skip
    }


def _train_flags(args, skip: Sequence[str] = (), **override) -> List[str]:
    """The flags that hand the demo's training settings on to a `train` worker."""
    argv = []
    for name, value in _settings(args, skip, **override).items():
        argv += [_flag(name), str(value)]
    return argv


def _base_overrides(args) -> dict:
    """How a continued-pretraining base trains: --base-steps at the settings' from-scratch
    defaults for the schedule, no learning curve."""
    defaults = TrainConfig(data_dir="", out_dir="")
    schedule = {name: getattr(defaults, name) for name in CONTINUED_SETTINGS}
    return {**schedule, "steps": args.base_steps, "curve_points": 0}


def _check(args) -> int:
    from .preflight import report

    result, data = _read_for_check(args)
    print(report(result, args.loss, args.alpha, data))
    if not result.ok and args.data_path is not None:
        print("--data-path not measured: counting digit targets needs a tokenizer with digit ids")
    return 0 if result.ok else 1


@contextlib.contextmanager
def _bad_input(what: str, fix: str) -> Iterator[None]:
    """Any crash reading `what` as one line (a ValueError: exit 2) that names it and the fix."""
    try:
        yield
    except (FileNotFoundError, ValueError):
        raise
    except Exception as exc:
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ValueError(f"{what} cannot be read ({why}): {fix}") from exc


def _read_for_check(args):
    """(preflight.Preflight, the --data-path's BlendShare or None) for `check`'s arguments."""
    from ..digits.data_share import parse_data_path
    from .preflight import check_tokenizer, measure_data

    if args.data_path is not None:  # its mistakes are named before the tokenizer loads
        parse_data_path(args.data_path)
    files = [f for f in (args.tokenizer, args.vocab_file, args.merge_file) if f is not None]
    what = " and ".join(map(repr, files)) or f"--tokenizer-type {args.tokenizer_type}"
    with _bad_input(what, "give the tokenizer your run loads, as Megatron-LM's flags name it"):
        result = check_tokenizer(
            args.tokenizer,
            args.tokenizer_type,
            args.allow_multi_digit_tokens,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            slot_logits=args.slot_logits,
            tiktoken_pattern=args.tiktoken_pattern,
            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
            vocab_size=args.vocab_size,
        )
    if args.data_path is None or not result.ok:
        return result, None
    with _bad_input("--data-path " + " ".join(args.data_path), "give the run's --data-path"):
        return result, measure_data(result, args.data_path, args.sample_tokens)


def _prepare(args) -> int:
    from .demo.data import prepare

    meta = prepare(args.out, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.seed)
    print(json.dumps(meta))
    return 0


def _train(args) -> int:
    import torch.distributed as dist

    from .demo.train import train

    _init_process_group()
    try:
        train(
            TrainConfig(
                **{
                    f.name: getattr(args, f.name)
                    for f in fields(TrainConfig)
                    if hasattr(args, f.name)
                }
            )
        )
    finally:
        dist.destroy_process_group()
    return 0


def _init_process_group() -> None:
    """gloo process group; under a torchrun agent, in this restart attempt's key space."""
    import torch.distributed as dist

    from ..cpu.rendezvous import per_attempt

    per_attempt(dist.init_process_group)("gloo")


def _torchrun(nproc: int, argv: List[str]) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "del_megatron.tools.cli",
        *argv,
    ]


def _demo(args) -> int:
    from .demo import continued
    from .demo.compare import read_run
    from .demo.report import curve_table, plot, plot_shape, table, write_results

    base_data, data_dir = continued.prepare_data(
        args.out, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.seed
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    resume = ["--resume"] if args.resume else []
    base_dir = os.path.join(args.out, continued.BASE_RUN)
    print(f"base: CE for {args.base_steps} steps on the base distribution")
    base_args = ["train", "--data-dir", base_data, "--out-dir", base_dir, "--loss", "ce"]
    base_args += ["--base-data-dir", base_data, *resume]
    base_args += _train_flags(args, **_base_overrides(args))
    code = subprocess.call(_torchrun(args.nproc, base_args), env=env)
    base = read_run(base_dir)
    if code != 0:
        print(f"training the base failed (exit {code})", file=sys.stderr)
        return code
    if not base.get("finished"):
        print("stopped before the last step; rerun with --resume to continue", file=sys.stderr)
        return 0
    runs = {}
    for loss in args.losses:
        out_dir = os.path.join(args.out, loss)
        print(f"{loss}: continued from the base for {args.steps} steps")
        train_args = ["train", "--data-dir", data_dir, "--out-dir", out_dir, "--loss", loss]
        train_args += ["--init-from", continued.checkpoints_of(base_dir)]
        train_args += ["--base-data-dir", base_data, "--slot-logits", args.slot_logits]
        train_args += [*_train_flags(args), *resume]
        code = subprocess.call(_torchrun(args.nproc, train_args), env=env)
        if code != 0:
            print(f"training with loss {loss!r} failed (exit {code})", file=sys.stderr)
            return code
        runs[loss] = read_run(out_dir)
    if not all(run.get("finished") for run in runs.values()):
        print("stopped before the last step; rerun with --resume to continue", file=sys.stderr)
        return 0
    continued.add_base_change({loss: {0: run} for loss, run in runs.items()}, {0: base})
    path = write_results(args.out, runs, base)
    png = plot(args.out, runs)
    shape = plot_shape(
        os.path.join(args.out, "results_shape.png"),
        {loss: [run] for loss, run in runs.items()},
        "del-megatron CPU demo: digit distributions at the held-out digit targets",
    )
    print(curve_table(runs))
    print(table(runs, base))
    print(f"wrote {path}, {png} and {shape}")
    return 0


def _compare(args) -> int:
    from .demo import continued
    from .demo.compare import sweep, write_report
    from .demo.data import prepare

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    bases: dict = {}
    before_seed = None
    if args.continue_from_base:
        base_data, data_dir = continued.prepare_data(
            args.out, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.data_seed
        )
        base_flags = _base_overrides(args)

        def train_base(seed: int, out_dir: str) -> int:
            argv = ["train", "--data-dir", base_data, "--out-dir", out_dir, "--loss", "ce"]
            argv += ["--alpha", "0.0", "--seed", str(seed), "--resume"]
            argv += ["--base-data-dir", base_data]
            argv += _train_flags(args, skip=COMPARE_SETS, **base_flags)
            return subprocess.call(_torchrun(args.nproc, argv), env=env)

        base_config = _settings(args, COMPARE_SETS, **base_flags)

        def before_seed(seed: int) -> None:
            bases[seed] = continued.ensure_base(args.out, seed, train_base, base_config)

    else:
        data_dir = os.path.join(args.out, "data")
        if not os.path.exists(os.path.join(data_dir, "meta.json")):
            prepare(
                data_dir, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.data_seed
            )
        base_data = None

    def train(arm, seed: int, out_dir: str) -> int:
        train_args = ["train", "--data-dir", data_dir, "--out-dir", out_dir, "--loss", arm.loss]
        train_args += ["--alpha", str(arm.weight), "--seed", str(seed), "--resume"]
        train_args += ["--slot-logits", arm.rule]
        if base_data is not None:  # continued from the seed's base
            base = continued.checkpoints_of(continued.base_run_dir(args.out, seed))
            train_args += ["--init-from", base, "--base-data-dir", base_data]
        train_args += _train_flags(args, skip=COMPARE_SETS)
        return subprocess.call(_torchrun(args.nproc, train_args), env=env)

    try:
        settings = _settings(args, COMPARE_SETS)
        results = sweep(args.out, args.losses, args.seeds, train, settings, before_seed=before_seed)
    except RuntimeError as exc:
        print(f"del-megatron compare: {exc}", file=sys.stderr)
        return 1
    if args.continue_from_base:
        continued.add_base_change(results, bases)
    paths = write_report(
        args.out, args.losses, args.seeds, results, bases if args.continue_from_base else None
    )
    with open(paths["md"]) as fh:
        print(fh.read(), end="")
    print(f"wrote {paths['json']}, {paths['md']}, {paths['png']} and {paths['shape']}")
    return 0


# compare --continue-from-base's arms by default, for a one-digit and a chunking tokenizer: DEL
# at the weights the paper wrote (0.1, 0.01) and at the one its Qwen2.5 run applied (1.28,
# docs/DEL.md).
CONTINUED_ARMS = ("ce", "del", "del@0.01", "del@1.28", "ntl_was", "dist2")
CONTINUED_ARMS_CHUNKED = ("ce", "del", "ntl_was")


def _default_arms(args) -> Sequence[str]:
    if not args.continue_from_base:
        return LOSSES
    return CONTINUED_ARMS_CHUNKED if args.tokenizer == CHUNKED else CONTINUED_ARMS


# Settings `compare` sets per run (from --losses and --seeds), not flags of its own.
COMPARE_SETS = ("alpha", "seed")
PAPER_WEIGHT_DEL = TrainConfig.__dataclass_fields__["alpha"].default


def _add_train_args(
    parser: argparse.ArgumentParser,
    skip: Sequence[str] = (),
    continued: Optional[str] = None,
) -> None:
    """The TrainConfig settings as flags. continued="always": the continued-pretraining
    schedule (CONTINUED_SETTINGS) is the default; "flag": it is the default with
    --continue-from-base, TrainConfig's without (resolved by parse_args)."""
    defaults = TrainConfig(data_dir="", out_dir="")
    for f in fields(TrainConfig):
        if f.name in NOT_FLAGS or f.name in skip:
            continue
        default = getattr(defaults, f.name)
        shown = f"default {default}"
        if continued is not None and f.name in CONTINUED_SETTINGS:
            later = CONTINUED_SETTINGS[f.name]
            if continued == "always":
                default, shown = later, f"default {later}: the continued runs'"
            else:
                shown = f"default {default}; {later} with --continue-from-base"
                default = None
        parser.add_argument(
            _flag(f.name),
            type=_setting_type(f, type(getattr(defaults, f.name))),
            default=default,
            help=f"{f.metadata['help']} ({shown})",
        )


def _continued_args(parser: argparse.ArgumentParser, positive: Callable) -> None:
    parser.add_argument(
        "--base-steps",
        type=positive,
        default=BASE_STEPS,
        help="steps of the CE base that the runs continue from, at the from-scratch schedule "
        f"(default {BASE_STEPS})",
    )


def _resolve_schedule(args) -> None:
    """compare's schedule settings left at None: the continued ones with --continue-from-base,
    TrainConfig's otherwise."""
    defaults = TrainConfig(data_dir="", out_dir="")
    for name, later in CONTINUED_SETTINGS.items():
        if getattr(args, name) is None:
            setattr(args, name, later if args.continue_from_base else getattr(defaults, name))


def _check_model_shape(parser: argparse.ArgumentParser, args, tp: Optional[int]) -> None:
    """What Megatron would refuse after the launch, refused before it."""
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if tp is not None and args.heads % tp:
        parser.error(f"--heads {args.heads} must be a multiple of --nproc {tp} (the TP size)")
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")


def _slot_logits_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slot-logits",
        choices=RULES,
        default=DEFAULT_SLOT_LOGITS,
        help="a chunking tokenizer's slot rule (docs/DEL.md; no effect with one digit a token; "
        f"default {DEFAULT_SLOT_LOGITS})",
    )


def build_parser() -> argparse.ArgumentParser:
    from ..config import DEFAULT_ALPHA
    from ..digits.data_share import DEFAULT_SAMPLE_TOKENS

    parser = argparse.ArgumentParser(prog="del-megatron", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    positive = _number(int, POSITIVE)
    seed = _number(int, NON_NEGATIVE)

    def data_args(p):
        p.add_argument(
            "--corpus",
            type=_existing("corpus", want_file=True),
            default=None,
            help='JSONL with a "text" per line (default: the seeded synthetic corpus)',
        )
        p.add_argument(
            "--tokenizer",
            type=_existing("tokenizer", want_file=False, keyword=CHUNKED),
            default=None,
            help="tokenizer file or folder, or 'chunked' to train a byte-level BPE that cuts "
            "numbers into chunks of up to 3 digits as Llama-3's does (default: train a "
            "digit-splitting SentencePiece model on the corpus)",
        )
        p.add_argument(
            "--num-docs",
            type=positive,
            default=20000,
            help="synthetic training problems (default 20000; ignored with --corpus)",
        )
        p.add_argument(
            "--num-eval", type=positive, default=1000, help="held-out problems (default 1000)"
        )

    check = sub.add_parser(
        "check",
        help="a tokenizer's digit ids for DEL, the weight recommended for its family, and the "
        "Megatron-LM flags to add",
        description="Read a tokenizer as Megatron-LM's --tokenizer-type would, report its digit "
        "and decimal-point ids and whether numbers split one digit per token or in chunks, name "
        "its family and the weight the DEL paper's run for that family applied (0.1 "
        "SentencePiece: CodeLlama, Mistral 7B; 1.28 Qwen2.5; 2.56 DeepSeek-Math; "
        f"{DEFAULT_ALPHA:g}, --del-alpha's default, for families no paper run used), and print "
        "the flags to add to pretrain_gpt.py or pretrain_hybrid.py.",
        epilog="Exit status: 0 the tokenizer can serve DEL (its flags printed); 1 it cannot "
        "(the reason printed); 2 bad input or usage (a flag, a missing file, a file that is not "
        "the tokenizer it should be: one line on stderr naming it).",
    )
    check.add_argument(
        "--tokenizer",
        "--tokenizer-model",
        type=_existing("tokenizer", want_file=False),
        default=None,
        help="tokenizer file or folder (Megatron-LM's --tokenizer-model): SentencePiece "
        ".model, .tiktoken, tekken JSON, tokenizer.json or a folder holding it",
    )
    check.add_argument(
        "--tokenizer-type",
        default=None,
        help="Megatron-LM's --tokenizer-type (e.g. HuggingFaceTokenizer, GPT2BPETokenizer, "
        "NullTokenizer)",
    )
    check.add_argument(
        "--vocab-file",
        type=_existing("--vocab-file", want_file=True),
        default=None,
        help="GPT2BPETokenizer's vocab.json (Megatron-LM's --vocab-file; implies "
        "--tokenizer-type GPT2BPETokenizer)",
    )
    check.add_argument(
        "--merge-file",
        type=_existing("--merge-file", want_file=True),
        default=None,
        help="GPT2BPETokenizer's merges.txt (Megatron-LM's --merge-file)",
    )
    check.add_argument(
        "--tiktoken-pattern",
        choices=("v1", "v2"),
        default="v2",
        help="TikTokenizer's split pattern (Megatron-LM's --tiktoken-pattern, default v2)",
    )
    check.add_argument(
        "--tiktoken-num-special-tokens",
        type=_number(int, NON_NEGATIVE),
        default=1000,
        help="TikTokenizer's id offset (Megatron-LM's --tiktoken-num-special-tokens, default 1000)",
    )
    check.add_argument(
        "--vocab-size",
        type=positive,
        default=None,
        help="TikTokenizer's vocabulary size (Megatron-LM's --vocab-size; default its 131072)",
    )
    check.add_argument(
        "--del-slot-logits",
        dest="slot_logits",
        choices=RULES,
        default=None,
        help="the run's --del-slot-logits: with a chunking tokenizer, count every digit of its "
        "multi-digit tokens in the --data-path share (and print the flag); without it the share "
        "counts the ten single-digit tokens the run trains",
    )
    check.add_argument(
        "--allow-multi-digit-tokens",
        "--del-allow-multi-digit-tokens",
        action="store_true",
        help="accept a tokenizer whose numbers hold other tokens than the ten digits (digits "
        "merged, or GPT-2's tokens for a digit after a space): DEL then applies to its bare "
        "single-digit tokens only (adds --del-allow-multi-digit-tokens to the flags)",
    )
    check.add_argument(
        "--loss",
        default="del",
        choices=[n for n in LOSSES if n != "ce"],
        help="the numerical loss to print flags for (default del)",
    )
    check.add_argument(
        "--alpha",
        type=_ruled(float, check_weight, "alpha"),
        default=None,
        help="the weight to put in the flags (default: the one recommended for the "
        f"tokenizer's family; --del-alpha itself defaults to {DEFAULT_ALPHA:g})",
    )
    check.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        metavar="PREFIX",
        help="Megatron-LM's --data-path (PREFIX ... or WEIGHT PREFIX ...): measure the share of "
        "its label positions that are digit targets, and print the --del-reduction token flags "
        "with it",
    )
    check.add_argument(
        "--sample-tokens",
        type=positive,
        default=DEFAULT_SAMPLE_TOKENS,
        help="with --data-path: about how many tokens to read from each dataset, in whole "
        f"documents spread evenly over it (default {DEFAULT_SAMPLE_TOKENS:,})",
    )
    check.set_defaults(func=_check)

    prep = sub.add_parser("prepare", help="write the corpus as a Megatron indexed dataset")
    prep.add_argument(
        "--out", required=True, type=_out_dir, help="folder to write the dataset into"
    )
    prep.add_argument(
        "--seed", type=seed, default=1234, help="seed of the synthetic corpus (default 1234)"
    )
    data_args(prep)
    prep.set_defaults(func=_prepare)

    demo = sub.add_parser(
        "demo",
        help="continue a CE base with CE and with DEL on CPU with torchrun, and compare",
        description="Continued pretraining, as users run DEL: prepare the base and the "
        "continued (number-heavier) data once, pretrain a base with CE on the base data, then "
        "continue it with one run per loss on the continued data (same weights, same data "
        "order) under torchrun (TP = --nproc, gloo), score the held-out problems during "
        "training and at the end, and write results.json, results.png and results_shape.png "
        "into --out.",
    )
    demo.add_argument(
        "--out", default="runs/demo", type=_out_dir, help="output folder (default runs/demo)"
    )
    demo.add_argument(
        "--losses",
        nargs="+",
        default=["ce", "del"],
        choices=DEMO_LOSSES,
        help=f"losses to train, one run each (default: ce del; {SINGLE_DIGIT_DEL} is DEL on "
        "the single-digit tokens only, for a chunking tokenizer)",
    )
    demo.add_argument(
        "--nproc", type=positive, default=2, help="processes = tensor-parallel size (default 2)"
    )
    demo.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    _slot_logits_arg(demo)
    data_args(demo)
    _continued_args(demo, positive)
    _add_train_args(demo, continued="always")
    demo.set_defaults(func=_demo)

    compare = sub.add_parser(
        "compare",
        help="train every loss from the same seeds and compare them with 95%% intervals",
        description="Every loss in --losses from every seed in --seeds, on the same data, in "
        "the same order; each run scored on a fixed subset of the held-out problems during "
        "training (the learning curves) and on all of them at the end; per metric the mean "
        "over seeds with a 95% Student-t interval and the paired difference against ce. A "
        "rerun skips finished runs and continues an unfinished one from its checkpoint. "
        f"Weights: LOSS takes its paper setting (del {PAPER_WEIGHT_DEL:g}, ntl_was and ntl_mse "
        "0.3, dist2 and digit_ce as del); LOSS@W sets W (repeat a loss to sweep it).",
    )
    compare.add_argument(
        "--out", default="runs/compare", type=_out_dir, help="output folder (default runs/compare)"
    )
    compare.add_argument(
        "--losses",
        nargs="+",
        type=_arm,
        default=None,
        metavar="LOSS[:RULE][@WEIGHT]",
        help=f"losses ({', '.join(DEMO_LOSSES)}), each at its paper weight or @WEIGHT, with "
        f"a chunking tokenizer's slot rule :{'/:'.join(RULES)} or the default "
        f"(default all but {SINGLE_DIGIT_DEL}, which is del on a one-digit tokenizer; with "
        f"--continue-from-base: {' '.join(CONTINUED_ARMS)}, or {' '.join(CONTINUED_ARMS_CHUNKED)} "
        "with --tokenizer chunked)",
    )
    compare.add_argument(
        "--continue-from-base",
        action="store_true",
        help="continued pretraining: per seed, pretrain a CE base on the base data for "
        "--base-steps, then continue it with every loss on a number-heavier distribution "
        "(longer operands, more decimal places) at the continued schedule; also scores the "
        "base distribution's held-out CE before and after (docs/results.md)",
    )
    _continued_args(compare, positive)
    compare.add_argument(
        "--seeds",
        nargs="+",
        type=seed,
        default=[11, 22, 33, 44, 55],
        help="seeds: each fixes the initial weights and the data order (default 11 22 33 44 55)",
    )
    compare.add_argument(
        "--nproc", type=positive, default=2, help="processes = tensor-parallel size (default 2)"
    )
    compare.add_argument(
        "--data-seed", type=seed, default=1234, help="seed of the synthetic corpus (default 1234)"
    )
    data_args(compare)
    _add_train_args(compare, skip=COMPARE_SETS, continued="flag")
    compare.set_defaults(func=_compare)

    from .qa.commands import add_commands

    add_commands(sub, _arm, positive, _existing)

    train = sub.add_parser("train", help="one training run (the torchrun worker)")
    train.add_argument(
        "--data-dir",
        required=True,
        type=_existing("data dir", want_file=False),
        help="a folder written by prepare",
    )
    train.add_argument(
        "--out-dir", required=True, type=_out_dir, help="where metrics.json and checkpoints go"
    )
    train.add_argument("--loss", default="del", choices=DEMO_LOSSES, help="the loss (default del)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    _slot_logits_arg(train)
    train.add_argument(
        "--init-from",
        type=_existing("--init-from", want_file=False, keyword=""),
        default="",
        help="continued pretraining: the checkpoints folder of the run whose weights to start "
        "from (optimizer and schedule start afresh)",
    )
    train.add_argument(
        "--base-data-dir",
        type=_existing("--base-data-dir", want_file=False, keyword=""),
        default="",
        help="a prepared data folder whose held-out texts are scored for CE at the end",
    )
    train.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    _add_train_args(train)
    train.set_defaults(func=_train)
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parsed and checked arguments; exits with argparse's usage error (status 2) on bad ones."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "compare":
        _resolve_schedule(args)
    if args.command in ("demo", "train", "compare"):
        _check_model_shape(parser, args, None if args.command == "train" else args.nproc)
    if args.command == "compare":
        if args.losses is None:
            args.losses = [_arm(name) for name in _default_arms(args)]
        names = [arm.name for arm in args.losses]
        if len(set(names)) != len(names):
            parser.error(f"--losses names a run twice: {' '.join(names)}")
        if len(set(args.seeds)) != len(args.seeds):
            parser.error(f"--seeds repeats a seed: {' '.join(map(str, args.seeds))}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """The console script; returns the exit status (2 for bad arguments or input)."""
    # megatron-core says so on import when apex / Transformer Engine (GPU-only) are absent
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    if argv is None:  # a process of its own (the console script, a torchrun worker)
        skip_final_collections()
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"del-megatron {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
