"""gpu_check's integration stage: Megatron-LM's pretrain_gpt.py through del_megatron's drop-in,
logits-free off and on, for each of the two DEL reductions, on a corpus with many numbers.

This file is also the torchrun entry of each run:

    torchrun --nproc-per-node 2 benchmarks/gpu_integration.py OUT_PREFIX \
        examples/pretrain_gpt_del.py <pretrain_gpt.py flags>

When iteration 1 calls the optimizer's step (after backward and Megatron's gradient reduction,
before clipping and the update), every rank saves output_layer.weight's main_grad (the buffer
Megatron's DDP and optimizer use; .grad where there is none) as fp32 on the CPU to
OUT_PREFIX.rank<r>.pt. Run from a Megatron-LM checkout (or with MEGATRON_LM_DIR set), as the
drop-in.
"""

from __future__ import annotations

import inspect
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy
import torch

ROOT = Path(__file__).resolve().parents[1]
DIGIT_IDS = tuple(range(10, 20))  # digit d is token 10 + d
FIRST_WORD_ID = 30
REDUCTIONS = ("digit", "token")
# The token runs' --del-digit-share: the corpus's designed share of digits (corpus()).
CORPUS_DIGIT_SHARE = 0.38
RUNS = ("materialised", "logits_free")

# A small GPT with the flags GPU users train with: bf16, the distributed optimizer with the
# gradient reduce-scatter and the parameter all-gather overlapped in DDP buckets small enough
# that the output weight has its own (so logits-free waits on its all-gather in the layer's
# pre-hook), MTP (with RoPE), an untied output layer.
MODEL = [
    "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant", "--seed", "1234",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--num-workers", "0",
    "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1",
    "--position-embedding-type", "rope", "--bf16", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "100000",
    "--numerical-loss", "del", "--del-alpha", "0.1",
    "--del-digit-token-ids", *map(str, DIGIT_IDS),
]  # fmt: skip
GPU_VOCAB, CPU_VOCAB = 151936, 1024
# The TE spec; gradient-accumulation fusion stays on (Megatron-LM's default).
GPU_FLAGS = ["--transformer-impl", "transformer_engine", "--vocab-size", str(GPU_VOCAB)]
CPU_FLAGS = [
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--vocab-size", str(CPU_VOCAB),
]  # fmt: skip


def write_number_corpus(prefix: Path, vocab: int, tokens: int, seed: int = 0) -> Dict[str, float]:
    """An indexed dataset PREFIX.bin/.idx (megatron.core's IndexedDatasetBuilder, int32) of at
    least `tokens` NullTokenizer ids: sentences of 8-20 slots, each a number (1-6 digits, ids
    10-19) with probability 0.15, else a word (up to 4096 ids drawn from [30, vocab - 1), Zipf
    frequencies). About 38% of the tokens are digits. Returns {"documents", "tokens",
    "digit_share"}."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    ids = numpy.arange(FIRST_WORD_ID, vocab - 1)
    words = rng.choice(ids, size=min(4096, ids.size), replace=False)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    written = digits = documents = 0
    while written < tokens:
        document: List[int] = []
        for _ in range(rng.integers(4, 40)):  # sentences
            for _ in range(rng.integers(8, 21)):
                if rng.random() < 0.15:
                    number = [rng.integers(1, 10), *rng.integers(0, 10, rng.integers(0, 6))]
                    document += [DIGIT_IDS[d] for d in number]
                    digits += len(number)
                else:
                    document.append(int(words[min(rng.zipf(1.3), len(words)) - 1]))
        builder.add_document(numpy.asarray(document, dtype=numpy.int32), [len(document)])
        written += len(document)
        documents += 1
    builder.finalize(f"{prefix}.idx")
    return {"documents": documents, "tokens": written, "digit_share": digits / written}


def data_parallel(cuda: bool, gpus: int) -> Tuple[int, str]:
    """(ranks, why): DP 2 on the CPU (gloo) and with 2+ GPUs (one rank a GPU); DP 1 on one
    GPU, since NCCL refuses two ranks on one device."""
    if not cuda:
        return 2, "DP 2: two gloo ranks on the CPU"
    if gpus >= 2:
        return 2, f"DP 2: one rank on each of 2 of the {gpus} GPUs (NCCL)"
    return 1, (
        "DP 1: one GPU, and NCCL runs one rank a device; the same flags run, but the "
        "all-gather the output layer's pre-hook waits on spans one rank. DP 2 runs with 2+ "
        "GPUs and in gpu_check.sh --cpu"
    )


PORT = "<port>"  # the launcher puts a free port here


def commands(
    cuda: bool, ranks: int, out: Path, data_prefix: Path, iterations: int
) -> Dict[str, List[str]]:
    """{f"{reduction}_{run}": torchrun command line}, the digit reduction's pair first; each
    has PORT after --master-port."""
    flags = MODEL + (GPU_FLAGS if cuda else CPU_FLAGS)
    flags = flags + ["--train-iters", str(iterations), "--data-path", str(data_prefix)]
    flags += ["--data-cache-path", str(data_prefix.parent / "cache")]
    launched = {}
    for reduction in REDUCTIONS:
        for run in RUNS:
            extra = ["--del-reduction", reduction] + (
                ["--del-logits-free"] if run != RUNS[0] else []
            )
            if reduction == "token":
                extra += ["--del-digit-share", str(CORPUS_DIGIT_SHARE)]
            launched[f"{reduction}_{run}"] = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--master-port", PORT, str(Path(__file__).resolve()),
                str(out / f"integration_{reduction}_{run}_main_grad"),
                str(ROOT / "examples" / "pretrain_gpt_del.py"), *flags, *extra,
            ]  # fmt: skip
    return launched


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
_ENTRY = re.compile(r"^\s*([a-z][a-z0-9 _-]*?)\s*:\s*([-+0-9.eEnaNifINF]+)\s*$")


def parse_log(log: str) -> Dict[int, Dict[str, float]]:
    """{iteration: {name: value}} of Megatron-LM's training log lines ("lm loss", "del term",
    "digit tokens", ...)."""
    found = {}
    for line in log.splitlines():
        match = _ITERATION.search(line)
        if match:
            entries = (_ENTRY.match(part) for part in match[2].split("[Rank ")[0].split("|"))
            found[int(match[1])] = {m[1]: float(m[2]) for m in entries if m}
    return found


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def compare(
    logs: Dict[str, Dict[int, Dict[str, float]]],
    grads: Dict[str, Sequence[torch.Tensor]],
    iterations: int,
) -> Tuple[bool, dict]:
    """(ok, figures) of one reduction's two runs: both logged every iteration with digit
    targets in each; lm loss of iteration 1 within 0.1% and of every iteration within 2%; the
    DEL term of iteration 1 within 1%; each rank's output-layer main_grad before iteration 1's
    optimizer step within 5% (norm of the difference over the norm)."""
    want, got = logs["materialised"], logs["logits_free"]
    steps = list(range(1, iterations + 1))
    complete = all(sorted(log) == steps for log in (want, got))
    loss = {i: _rel(got[i]["lm loss"], want[i]["lm loss"]) for i in want if i in got}
    first = (want.get(1, {}), got.get(1, {}))
    term = _rel(first[1]["del term"], first[0]["del term"]) if "del term" in first[1] else None
    digits = [log[i].get("digit tokens", 0.0) for log in (want, got) for i in log]
    pairs = list(zip(grads["materialised"], grads["logits_free"], strict=True))
    grad_errors = [((b - a).norm() / a.norm().clamp(min=1e-30)).item() for a, b in pairs]
    ok = (
        complete
        and bool(pairs)
        and min(digits, default=0.0) > 0
        and loss.get(1, 1.0) < 1e-3
        and max(loss.values(), default=1.0) < 2e-2
        and term is not None
        and term < 1e-2
        and max(grad_errors) < 5e-2
    )
    figures = dict(
        lm_loss={i: want[i]["lm loss"] for i in want},
        lm_loss_rel_error=loss,
        del_term_rel_error=term,
        digit_share=first[0].get("digit share"),
        digit_tokens_min=min(digits, default=None),
        main_grad_rel_error=max(grad_errors, default=None),
        main_grad_norm=[a.norm().item() for a, _ in pairs],
        ranks_compared=len(pairs),
    )
    return ok, figures


def megatron_core_version(checkout: Path) -> Optional[Tuple[int, int]]:
    """(major, minor) of the checkout's megatron/core/package_info.py, None if unreadable."""
    try:
        text = (checkout / "megatron" / "core" / "package_info.py").read_text()
    except OSError:
        return None
    major, minor = (re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR"))
    return (int(major[1]), int(minor[1])) if major and minor else None


# ---- the torchrun entry -------------------------------------------------------------------------


def _output_weight(model):
    """output_layer.weight of the first model chunk (DDP and Float16Module wrapped)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    for name, param in chunk.named_parameters():
        if name.endswith("output_layer.weight") and "mtp" not in name:
            return param
    raise RuntimeError("no output_layer.weight in the model (tied embeddings?)")


def save_before_step(optimizer, weight, out_prefix: str) -> None:
    """Wrap this optimizer object's step: its first call saves the weight's gradient
    (main_grad, else .grad) to OUT_PREFIX.rank<r>.pt, then steps."""
    step = optimizer.step

    def step_saving_first(*args, **kwargs):
        optimizer.step = step
        grad = getattr(weight, "main_grad", None)
        grad = weight.grad if grad is None else grad
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(grad.detach().float().cpu(), f"{out_prefix}.rank{rank}.pt")
        return step(*args, **kwargs)

    optimizer.step = step_saving_first


def install(out_prefix: str) -> None:
    """Wrap megatron.training.training.train_step: its first call arms save_before_step."""
    from megatron.training import training

    original = training.train_step
    signature = inspect.signature(original)
    armed = [True]

    def train_step(*args, **kwargs):
        if armed:
            armed.clear()
            bound = signature.bind(*args, **kwargs).arguments
            save_before_step(bound["optimizer"], _output_weight(bound["model"]), out_prefix)
        return original(*args, **kwargs)

    training.train_step = train_step


def main() -> None:
    out_prefix, script = sys.argv[1], sys.argv[2]
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, os.environ.get("MEGATRON_LM_DIR", os.getcwd()))
    install(out_prefix)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
