"""The question/answer commands of `del-megatron` (their parsers and what they run):
gguf-to-hf, score-qa and compare-qa. They need Megatron-Bridge's environment
(`bash examples/setup_env.sh bridge`; docs/results.md)."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

# The schedule of docs/results.md's SmolLM2-135M / GSM8K comparison (chosen before any run).
DEFAULT_ARMS = ("ce", "del", "del@1.28")
DEFAULT_SEEDS = (1, 2, 3)


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
    from . import report
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
    try:
        results = sweep.all(args.losses, args.seeds)
    except RuntimeError as failed:  # a stage's own log has the details
        print(f"del-megatron compare-qa: {failed}", file=sys.stderr)
        return 1
    print(report.write(args.out, results, args.seeds))
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

    def qa_data(p, train: bool) -> None:
        if train:
            p.add_argument(
                "--train",
                required=True,
                type=existing("train JSONL", want_file=True),
                help="training problems, one JSON object a line",
            )
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
        p.add_argument(
            "--question-key", default="question", help="the question field (default question)"
        )
        p.add_argument("--answer-key", default="answer", help="the answer field (default answer)")
        p.add_argument(
            "--problems",
            type=positive,
            default=250,
            help="score the first N held-out problems, teacher-forced (default 250)",
        )
        p.add_argument(
            "--greedy",
            type=int,
            default=32,
            help="decode the first N of them greedily for final-answer accuracy (default 32)",
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
    qa_data(compare, train=True)
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
        help="seeds, each an order of the training problems (default 1 2 3)",
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
    compare.add_argument("--nproc", type=positive, default=1, help="tensor-parallel processes")
    compare.add_argument(
        "--threads", type=int, default=0, help="torch threads a process (default: torch's choice)"
    )
    compare.set_defaults(func=_compare_qa)
