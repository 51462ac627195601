"""The question/answer commands of `del-megatron` (their parsers and what they run):
gguf-to-hf, score-qa, compare-qa and matched-weight. They need Megatron-Bridge's environment
(`bash examples/setup_env.sh bridge`; docs/results.md)."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict

# docs/results.md's SmolLM2-135M / GSM8K comparison, declared before its runs: cross-entropy,
# the control digit_ce at DEL's weight and at the weight whose extra gradient on the digit
# targets' logits matches DEL 0.1's at step 1 (`del-megatron matched-weight`: 0.35-0.41 over
# the four seeds' first batches, their mean 0.38), DEL at 0.1, 0.3 and 1.28; four seeds; the
# first 500 test problems, teacher-forced; no greedy decoding (135M solves almost none).
DEFAULT_ARMS = ("ce", "digit_ce@0.1", "digit_ce@0.38", "del", "del@0.3", "del@1.28")
DEFAULT_SEEDS = (1, 2, 3, 4)
DEFAULT_PROBLEMS = 500


def _gguf_to_hf(args) -> int:
    from .gguf_model import gguf_to_hf

    gguf_to_hf(args.gguf, args.out)
    print(f"wrote {args.out} (de-quantized from {args.gguf})")
    return 0


def _score_qa(args) -> int:
    from .data import read_problems
    from .score import score

    problems = read_problems(args.data, args.question_key, args.answer_key)[: args.problems]
    result = score(args.hf_model, problems, args.greedy)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".partial", args.out)
    shown = {k: v for k, v in result.items() if isinstance(v, (int, float))}
    print(json.dumps(shown, indent=1))
    return 0


def _compare_qa(args) -> int:
    from . import published, report
    from .finetune import Schedule
    from .sweep import Sweep

    schedule = Schedule(
        iters=args.iters,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        lr=args.lr,
        warmup=args.warmup,
        seq_length=args.seq_length,
        tensor_parallel=args.nproc,
    )
    keys = (args.question_key, args.answer_key)
    sweep = Sweep(
        args.out,
        args.hf_model,
        args.train,
        args.test,
        schedule,
        args.problems,
        args.greedy,
        args.threads,
        keys,
    )
    done: Dict[str, Dict[int, dict]] = {}
    for path in args.published:
        for arm, runs in published.load(path).items():
            done.setdefault(arm, {}).update(runs)
    try:
        results = sweep.all(args.losses, args.seeds, done)
    except RuntimeError as failed:  # a stage's own log has the details
        print(f"del-megatron compare-qa: {failed}", file=sys.stderr)
        return 1
    for arm, runs in done.items():  # the published runs, beside this sweep's own
        results[arm] = {**runs, **results.get(arm, {})}
    print(report.write(args.out, results, args.seeds))
    return 0


def _matched_weight(args) -> int:
    from transformers import AutoTokenizer

    from .data import fitting, read_problems, training_order
    from .matched_weight import matched_weights

    tokenizer = AutoTokenizer.from_pretrained(args.hf_model)
    train = read_problems(args.train, args.question_key, args.answer_key)
    train = fitting(train, tokenizer, args.seq_length)
    orders = {seed: training_order(train, seed)[: args.batch] for seed in args.seeds}
    result = matched_weights(args.hf_model, orders, args.batch, args.loss, args.alpha, args.control)
    for seed, row in result.items():
        print(
            f"seed {seed}: ||grad {args.loss}|| {row[args.loss]:.4f}, ||grad {args.control}|| "
            f"{row[args.control]:.4f} over {row['digit_targets']:.0f} digit targets: "
            f"{args.control}@{row['matched_weight']:.4f} matches {args.loss}@{args.alpha:g}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(seed): row for seed, row in result.items()}, f, indent=1)
    return 0


def add_commands(sub, arm: Callable, positive: Callable, existing: Callable) -> None:
    """gguf-to-hf, score-qa and compare-qa on `sub` (the CLI's subparsers)."""
    gguf = sub.add_parser(
        "gguf-to-hf",
        help="de-quantize a GGUF model into a Hugging Face folder (transformers + gguf)",
        description="The model and tokenizer of a GGUF file as a Hugging Face folder (fp32 "
        "safetensors), which Megatron-Bridge imports. Quantized weights stay quantized "
        "weights, de-quantized: not the original model's.",
    )
    gguf.add_argument("gguf", type=existing("GGUF file", want_file=True), help="the .gguf file")
    gguf.add_argument("--out", required=True, help="the folder to write")
    gguf.set_defaults(func=_gguf_to_hf)

    def train_data(p) -> None:
        p.add_argument(
            "--train",
            required=True,
            type=existing("train JSONL", want_file=True),
            help="training problems, one JSON object a line",
        )

    def keys(p) -> None:
        p.add_argument(
            "--question-key", default="question", help="the question field (default question)"
        )
        p.add_argument("--answer-key", default="answer", help="the answer field (default answer)")

    def qa_data(p, train: bool, problems: int = 250, greedy: int = 32) -> None:
        if train:
            train_data(p)
            p.add_argument(
                "--test",
                required=True,
                type=existing("test JSONL", want_file=True),
                help="held-out problems (the first --problems are scored)",
            )
        else:
            p.add_argument(
                "--data",
                required=True,
                type=existing("JSONL", want_file=True),
                help="held-out problems, one JSON object a line",
            )
        keys(p)
        p.add_argument(
            "--problems",
            type=positive,
            default=problems,
            help=f"score the first N held-out problems, teacher-forced (default {problems})",
        )
        p.add_argument(
            "--greedy",
            type=int,
            default=greedy,
            help=f"decode the first N of them greedily for final-answer accuracy (default "
            f"{greedy})",
        )

    score = sub.add_parser(
        "score-qa",
        help="digit metrics and final-answer accuracy of a Hugging Face model on Q/A data",
    )
    score.add_argument(
        "--hf-model", required=True, type=existing("model", want_file=False), help="HF model folder"
    )
    qa_data(score, train=False)
    score.add_argument("--out", required=True, help="the JSON file to write")
    score.set_defaults(func=_score_qa)

    compare = sub.add_parser(
        "compare-qa",
        help="continue a Hugging Face model on Q/A data with each loss (Bridge), and score them",
        description="Per seed (the training data's order) and loss: Megatron-Bridge's "
        "finetune() from the model, loss on the answers only, exported to Hugging Face and "
        "scored on the held-out problems; the model as given is scored too (the base row). "
        "Per metric the mean over seeds with a 95% Student-t interval and the paired "
        "difference against ce. A rerun resumes; two beside each other share the work.",
    )
    compare.add_argument(
        "--hf-model", required=True, type=existing("model", want_file=False), help="HF model folder"
    )
    qa_data(compare, train=True, problems=DEFAULT_PROBLEMS, greedy=0)
    compare.add_argument("--out", default="runs/compare-qa", help="output folder")
    compare.add_argument(
        "--losses",
        nargs="+",
        type=arm,
        default=[arm(a) for a in DEFAULT_ARMS],
        metavar="LOSS[@WEIGHT]",
        help=f"default {' '.join(DEFAULT_ARMS)}",
    )
    compare.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=list(DEFAULT_SEEDS),
        help="seeds, each an order of the training problems (default 1 2 3 4)",
    )
    compare.add_argument("--iters", type=positive, default=32, help="iterations (default 32)")
    compare.add_argument("--global-batch", type=positive, default=8, help="problems a step")
    compare.add_argument("--micro-batch", type=positive, default=4, help="problems a micro-batch")
    compare.add_argument("--lr", type=float, default=2e-5, help="peak (cosine to 0)")
    compare.add_argument("--warmup", type=int, default=4, help="warmup iterations")
    compare.add_argument(
        "--seq-length",
        type=positive,
        default=384,
        help="tokens; longer training problems are left out",
    )
    compare.add_argument(
        "--published",
        nargs="+",
        default=[],
        type=existing("published results.json", want_file=True),
        metavar="RESULTS_JSON",
        help="runs already published (a results.json with its _problems.json beside it, of the "
        "same model, data and schedule): taken as done, and in the report",
    )
    compare.add_argument("--nproc", type=positive, default=1, help="tensor-parallel processes")
    compare.add_argument(
        "--threads", type=int, default=0, help="torch threads a process (default: torch's choice)"
    )
    compare.set_defaults(func=_compare_qa)

    matched = sub.add_parser(
        "matched-weight",
        help="the control's weight whose extra gradient on the digit targets' logits matches "
        "a numerical loss's at step 1",
        description="On the model as given and the first --batch problems of each seed's "
        "training order (compare-qa's): the norms of the extra gradient on the logits that "
        "--loss at --alpha and --control add at the digit targets (both on the mean term over "
        "the digit targets), and the --control weight that makes them equal.",
    )
    matched.add_argument(
        "--hf-model", required=True, type=existing("model", want_file=False), help="HF model folder"
    )
    train_data(matched)
    keys(matched)
    matched.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4], help="orders")
    matched.add_argument("--batch", type=positive, default=8, help="problems (default 8)")
    matched.add_argument(
        "--seq-length", type=positive, default=384, help="longer problems are left out"
    )
    matched.add_argument("--loss", default="del", help="the numerical loss (default del)")
    matched.add_argument("--alpha", type=float, default=0.1, help="its weight (default 0.1)")
    matched.add_argument("--control", default="digit_ce", help="the control (default digit_ce)")
    matched.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    matched.set_defaults(func=_matched_weight)
