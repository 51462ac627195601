"""Forward+backward time and peak memory of every loss against Megatron-Core's own
vocab_parallel_cross_entropy, on the same inputs in the same run.

    .venv/bin/python benchmarks/bench_loss.py --tokens 1024 4096 --vocab 32000 151936 --tp 1 2
    .venv/bin/python benchmarks/bench_loss.py --linear --tokens 4096 --vocab 151936 --hidden 512

Every case runs on `tp` real processes (gloo on CPU, NCCL on CUDA), each holding its
[s, b, V/tp] shard. Time is the median over --reps of one forward+backward (max over ranks), the
implementations taking turns, with the inputs made before the clock starts; forward_s and
backward_s are the two halves apart. Peak memory counts everything one forward+backward
allocates from before its logits shard (or, with --linear, its output-layer input) exists:
logits, working copies, gradients. On CPU it is the kernel's resident high-water mark (VmHWM,
reset before each step), measured in separate processes where glibc serves every buffer over
64 KiB by mmap so that freed memory leaves the resident set (that setting slows allocation, so
time is measured with the default allocator). On CUDA: CUDA events and
torch.cuda.max_memory_allocated.

Rows (`impl`): megatron_ce (the reference of every ratio), megatron_fused (its torch.compile'd
variant) and, on CUDA where Transformer Engine is installed, te_ce (Megatron's wrapper of TE's
parallel cross-entropy); ce, del, ntl_was, ntl_mse, dist2 (numerical_lm_loss, kernel "auto":
`kernel` names the one it took on this device); del_softmax, del_recompute and del_compiled
(DEL with each kernel forced); del_chunked and del_chunked_length (DEL with a chunking vocab,
slot rule "any" and "length": each rank's slot partial sums over its share of the 1,110 number
tokens, the multi-digit ones at scattered ids; the cost does not depend on the labels;
time_vs_del_paired: its time over del's in the same round, the median over rounds);
del_naive (plain autograd DEL over F.cross_entropy, TP 1);
ntloss_was (the `ntloss` package's NTL-WAS plus Megatron CE, TP 1, when installed); with fp32,
del_copy (DEL without inplace: the caller's logits stay intact); ce_arm (what `--numerical-loss
ce`, the A/B's control arm, computes per micro-batch: loss_parts with loss "ce", the per-token
loss parts.token_loss(0.0) the model returns, and telemetry.digit_stats under a mask of ones, the
digit metrics it logs; time_vs_ce_paired: its time over ce's in the same round, the median over
rounds; ce and ce_arm also get time_vs_megatron_ce_paired). fp32 rows use inplace=True, as
Megatron's CE overwrites fp32 logits itself. place_weights is timed alone (`place_weights_s`).
With --linear: linear_materialised (output layer matmul + numerical_lm_loss) against
linear_logits_free (numerical_linear_loss with loss_mask, as --del-logits-free runs it: gradients
formed in forward, the weight gradient on the "auto" route), linear_logits_free_forward and
_backward (each route forced) and linear_recompute (without loss_mask: multiplied out again in
backward); weight_gradient is the route a row took, accumulator_mib its fp32 [V/tp, h]
weight-gradient accumulator (0 on the "backward" route) and accumulator_share its part of that
row's peak. The control arm logits-free: linear_megatron_ce (the matmul + Megatron's
vocab_parallel_cross_entropy: stock Megatron-LM), linear_ce (numerical_linear_loss with loss
"ce" and loss_mask) and linear_ce_arm (the same with return_parts=True, token_loss(0.0) and
digit_stats, as `--numerical-loss ce --del-logits-free` runs it); with --linear, time_ratio and
peak_ratio are against linear_materialised, time_vs_megatron_ce and peak_vs_megatron_ce against
linear_megatron_ce (and the _paired times as above, against linear_ce and linear_megatron_ce).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import del_megatron as dm  # noqa: E402
from del_megatron.digits.numbers import number_layout  # noqa: E402
from del_megatron.heads import HEADS  # noqa: E402
from del_megatron.loss import LOSSES  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VOCAB = dm.DigitVocab(digit_ids=range(15, 25), decimal_point_ids=[13])
# The same ids in a chunking vocab (Llama-3's digits and point), its 1,100 two- and three-digit
# tokens at ids drawn at random below 32000 (the smallest vocab here), scattered as a BPE
# scatters them (Llama-3.2's lie between 410 and 28,384): the del_chunked row.
CHUNKED_VOCAB = dm.DigitVocab(
    VOCAB.digit_ids,
    VOCAB.decimal_point_ids,
    (30 + torch.randperm(32000 - 30, generator=torch.Generator().manual_seed(3))[:1100]).tolist(),
)
ALPHA = 0.01


def _status_kib(field: str, path: str = "/proc/self/status") -> int:
    with open(path) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


class Meter:
    """Forward time, backward time and peak memory of one step on this device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start_memory(self) -> None:
        """The memory baseline: taken before the step's inputs exist."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _status_kib("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")

    def mark(self) -> None:
        """A point in time: the start, the end of forward, the end of backward."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def start_time(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks = []
        self.mark()

    def stop(self):
        """(forward seconds, backward seconds, peak bytes above the memory baseline)."""
        if self.cuda:
            torch.cuda.synchronize()
            seconds = [
                a.elapsed_time(b) / 1e3
                for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)
            ]
            return (*seconds, torch.cuda.max_memory_allocated() - self.base)
        seconds = [b - a for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)]
        return (*seconds, _status_kib("VmHWM") * 1024 - self.base)


def _labels(tokens: int, vocab: int, device=None) -> torch.Tensor:
    """[b=1, s=tokens]: about 15% digits in numbers, like a math corpus."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(30, vocab, (1, tokens), generator=gen)
    digits = torch.randint(15, 25, (1, tokens), generator=gen)
    labels = torch.where(torch.rand(1, tokens, generator=gen) < 0.15, digits, labels)
    return labels.to(device or "cpu")


def _naive_del(labels, logits):
    """DEL as a user would write it with autograd: upcast, F.cross_entropy, gathered digits."""
    x = logits.float().transpose(0, 1)  # [b, s, V]
    ce = F.cross_entropy(x.reshape(-1, x.size(-1)), labels.reshape(-1), reduction="none")
    layout = number_layout(labels, VOCAB)
    z = torch.where(layout.is_digit.unsqueeze(-1), x[..., list(VOCAB.digit_ids)], 0.0)
    w = dm.place_weights(labels, VOCAB)
    term = HEADS["del"](z.reshape(-1, 10), layout.digit.reshape(-1), w.reshape(-1))
    return (ce + ALPHA * term).view(labels.shape)


def _ntloss_was(labels, logits):
    """The ntloss package's NTL-WAS (single device) added to Megatron's CE."""
    from megatron.core import tensor_parallel

    ce = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()
    ntl = _NTLOSS.get("fn")
    if ntl is None:
        ntl = _NTLOSS["fn"] = _make_ntloss(logits.size(-1))
    term = ntl(logits.transpose(0, 1), labels, reduction="none")
    return ce + ALPHA * term


_NTLOSS: dict = {}


def _make_ntloss(vocab_size: int):
    """ntloss.NTLoss over a word-level HF tokenizer whose ids 15..24 are the digits 0..9."""
    from ntloss import NTLoss
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(30)}
    words.update({str(k): i for k, i in enumerate(VOCAB.digit_ids)})
    words["[UNK]"] = 0
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="[UNK]")))
    return NTLoss(tok, vocab_size=vocab_size, digit_level=True, reweigh=False)


def _have_ntloss() -> bool:
    try:
        import ntloss  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def loss_implementations(dtype_name: str, tp: int, group, device: torch.device):
    """name -> fn(labels [b, s], logits [s, b, V/tp]) returning a [b, s] loss."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    inplace = dtype_name == "fp32"  # what Megatron's own CE does to fp32 logits
    layout = dm.VocabParallelLayout(tp_group=group)

    def megatron_ce(labels, logits):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()

    def megatron_fused(labels, logits):
        return fused_vocab_parallel_cross_entropy(logits, labels.t().contiguous(), group).t()

    def ours(loss, vocab=VOCAB, slot_logits="any", **how):
        how.setdefault("inplace", inplace)
        cfg = dm.NumericalLossConfig(loss=loss, alpha=ALPHA, vocab=vocab, slot_logits=slot_logits)
        return lambda labels, logits: dm.numerical_lm_loss(labels, logits, cfg, layout, **how)

    impls = {"megatron_ce": megatron_ce, "megatron_fused": megatron_fused}
    te_ce = _te_parallel_cross_entropy() if device.type == "cuda" else None
    if te_ce is not None:

        def te(labels, logits):
            labels = labels.t().contiguous()
            labels = torch.as_strided(labels, labels.size(), (labels.size(1), 1))
            return te_ce(logits, labels, group).t()

        impls["te_ce"] = te
    for loss in LOSSES:
        impls[loss] = ours(loss)
    impls["del_softmax"] = ours("del", kernel="softmax")
    impls["del_recompute"] = ours("del", kernel="recompute")
    impls["del_compiled"] = ours("del", kernel="compiled")
    impls["del_chunked"] = ours("del", vocab=CHUNKED_VOCAB, slot_logits="any")
    impls["del_chunked_length"] = ours("del", vocab=CHUNKED_VOCAB, slot_logits="length")
    if dtype_name == "fp32":
        impls["del_copy"] = ours("del", inplace=False)
    impls["ce_arm"] = _ce_arm(layout, inplace)
    if tp == 1:
        impls["del_naive"] = _naive_del
        if _have_ntloss():
            impls["ntloss_was"] = _ntloss_was
    return impls


CE_CFG = dm.NumericalLossConfig(loss="ce", alpha=ALPHA, vocab=VOCAB)


def _ce_arm(layout, inplace: bool):
    """The A/B's control arm (--numerical-loss ce) per micro-batch, materialised: the parts, the
    per-token loss the model returns, and the digit metrics its telemetry logs (all computed in
    the timed forward; nothing read on the host)."""
    from del_megatron.megatron.telemetry import digit_stats

    def fn(labels, logits):
        parts = dm.loss_parts(labels, logits, CE_CFG, layout, inplace=inplace)
        _METRICS[:] = digit_stats(torch.ones(labels.shape, device=labels.device), parts)
        return parts.token_loss(CE_CFG.token_weight)

    return fn


# The last control-arm row's digit metrics, kept so that they are computed (and, on CUDA,
# queued inside the timed forward).
_METRICS: list = []


def _te_parallel_cross_entropy():
    """Megatron's wrapper of Transformer Engine's parallel cross-entropy, None without TE."""
    try:
        from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy
    except ImportError:
        return None
    return te_parallel_cross_entropy


# The numerical_lm_loss rows besides those named after a loss.
NUMERICAL_LM_ROWS = ("del_copy", "del_chunked", "del_chunked_length", "ce_arm")
# Kernel each numerical_lm_loss row forces; the others take "auto".
FORCED_KERNELS = {
    "del_softmax": "softmax",
    "del_recompute": "recompute",
    "del_compiled": "compiled",
}


def kernel_of(name: str, case) -> str | None:
    """The kernel a numerical_lm_loss row runs for this case (None for other rows)."""
    from types import SimpleNamespace

    from del_megatron.kernels import resolve_kernel

    if name in FORCED_KERNELS:
        return FORCED_KERNELS[name]
    if name not in LOSSES and name not in NUMERICAL_LM_ROWS:
        return None
    logits = SimpleNamespace(device=torch.device(case["device"]), dtype=DTYPES[case["dtype"]])
    inplace = case["dtype"] == "fp32" and name != "del_copy"
    return resolve_kernel("auto", logits, inplace)


# The logits-free rows and the weight-gradient route each asks for ("auto": what
# --del-logits-free runs).
LINEAR_ROUTES = {
    "linear_logits_free": "auto",
    "linear_logits_free_forward": "forward",
    "linear_logits_free_backward": "backward",
}


def linear_implementations(tp: int, group):
    """name -> fn(labels, hidden [s, b, h], weight [V/tp, h]) returning a [b, s] loss."""
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    layout = dm.VocabParallelLayout(tp_group=group)

    def materialised(labels, hidden, weight):
        if tp > 1:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden)
        return dm.numerical_lm_loss(labels, torch.matmul(hidden, weight.t()), cfg, layout)

    def logits_free(route):
        def fn(labels, hidden, weight):
            # loss_mask, as --del-logits-free passes Megatron's: the step's upstream gradient is
            # proportional to it (here loss.sum()), so the gradients are formed in forward
            mask = torch.ones(labels.shape, device=labels.device)
            return dm.numerical_linear_loss(
                hidden, weight, labels, cfg, layout, loss_mask=mask, weight_gradient=route
            )

        return fn

    def recompute(labels, hidden, weight):
        return dm.numerical_linear_loss(hidden, weight, labels, cfg, layout)

    impls = {"linear_materialised": materialised}
    impls.update({name: logits_free(route) for name, route in LINEAR_ROUTES.items()})
    impls["linear_recompute"] = recompute
    impls.update(_linear_ce_arm(tp, layout))
    return impls


def _linear_ce_arm(tp: int, layout):
    """The control arm (--numerical-loss ce) logits-free, and stock Megatron-LM's loss on the
    same output layer: name -> fn(labels, hidden, weight)."""
    from megatron.core import tensor_parallel

    from del_megatron.megatron.telemetry import digit_stats

    def megatron_ce(labels, hidden, weight):
        if tp > 1:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        logits = torch.matmul(hidden, weight.t())
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()

    def ce(labels, hidden, weight):
        mask = torch.ones(labels.shape, device=labels.device)
        return dm.numerical_linear_loss(hidden, weight, labels, CE_CFG, layout, loss_mask=mask)

    def ce_arm(labels, hidden, weight):
        mask = torch.ones(labels.shape, device=labels.device)
        parts = dm.numerical_linear_loss(
            hidden, weight, labels, CE_CFG, layout, return_parts=True, loss_mask=mask
        )
        _METRICS[:] = digit_stats(mask, parts)
        return parts.token_loss(CE_CFG.token_weight)

    return {"linear_megatron_ce": megatron_ce, "linear_ce": ce, "linear_ce_arm": ce_arm}


def _one_step(fn, make_inputs, meter):
    """(forward s, backward s, peak bytes) of one forward+backward. The inputs are made before
    the clock starts, but after the memory baseline: peak memory counts them (the logits, or
    the output layer's input)."""
    meter.start_memory()
    labels, tensors = make_inputs()
    meter.start_time()
    loss = fn(labels, *tensors)
    meter.mark()
    # autograd.grad, as the output layer's backward would take it: no AccumulateGrad copy.
    grads = torch.autograd.grad(loss.sum(), tensors)
    meter.mark()
    del loss, grads
    return meter.stop()


def _make_inputs(case, rank, world, device):
    tokens, vocab, dtype = case["tokens"], case["vocab"], DTYPES[case["dtype"]]
    local = vocab // world
    labels = _labels(tokens, local * world, device)
    gen = torch.Generator(device=device).manual_seed(rank)
    if case.get("hidden"):
        h = case["hidden"]
        weight = (torch.randn(local, h, generator=gen, device=device) / h**0.5).to(dtype)

        def make():
            hidden = torch.randn(tokens, 1, h, generator=gen, device=device, dtype=dtype)
            return labels, (hidden.requires_grad_(True), weight.requires_grad_(True))

        return make

    def make():
        logits = torch.randn(tokens, 1, local, generator=gen, device=device, dtype=dtype)
        return labels, (logits.requires_grad_(True),)

    return make


def _fits(case, name, device) -> bool:
    """del_naive and ntloss_was hold about five fp32 [N, V] tensors; skipped where that would
    not fit."""
    if name not in ("del_naive", "ntloss_was"):
        return True
    need = 5 * 4 * case["tokens"] * case["vocab"]
    if device.type == "cuda":
        return need < 0.8 * torch.cuda.mem_get_info()[0]
    return need < 0.7 * _status_kib("MemAvailable", "/proc/meminfo") * 1024


def _worker(rank, world, port, case, phase, reps, names, queue, threads=None):
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(case["device"], rank if case["device"] == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
    )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    if case.get("hidden"):
        impls = linear_implementations(world, group)
    else:
        impls = loss_implementations(case["dtype"], world, group, device)
    impls = {n: f for n, f in impls.items() if (not names or n in names) and _fits(case, n, device)}
    make_inputs = _make_inputs(case, rank, world, device)
    meter = Meter(device)
    rows = {name: {} for name in impls}
    for name in impls:
        _one_step(impls[name], make_inputs, meter)  # warm-up (and compilation)
    if phase == "memory" or device.type == "cuda":
        for name, fn in impls.items():
            rows[name]["peak_mib"] = _one_step(fn, make_inputs, meter)[-1] / 2**20
    if phase == "time":
        # Round-robin with a rotating order, so that drift and the page-fault cost of fresh
        # buffers fall on every implementation alike.
        order = list(impls)
        times = {name: [] for name in order}
        for rep in range(reps):
            shift = rep % len(order)
            for name in order[shift:] + order[:shift]:
                times[name].append(_one_step(impls[name], make_inputs, meter)[:2])
        totals = {name: [fwd + bwd for fwd, bwd in times[name]] for name in order}
        for name in order:
            total = totals[name]
            rows[name].update(
                time_s=statistics.median(total),
                time_min_s=min(total),
                forward_s=statistics.median(fwd for fwd, _ in times[name]),
                backward_s=statistics.median(bwd for _, bwd in times[name]),
            )
            for key, against in PAIRED.get(name, {}).items():
                if against in totals:
                    rows[name][key] = _paired_ratio(total, totals[against])
        if not case.get("hidden"):
            rows["place_weights"] = {"time_s": _time_place_weights(make_inputs()[0], reps)}
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        merged = {
            name: {key: max(r[name][key] for r in gathered) for key in rows[name]} for name in rows
        }
        queue.put(merged)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


# Rows timed against another in the same rounds, besides megatron_ce (row -> {key: other}).
PAIRED = {
    "del_chunked": {"time_vs_del_paired": "del"},
    "del_chunked_length": {"time_vs_del_paired": "del"},
    "ce": {"time_vs_megatron_ce_paired": "megatron_ce"},
    "ce_arm": {"time_vs_ce_paired": "ce", "time_vs_megatron_ce_paired": "megatron_ce"},
    "linear_ce": {"time_vs_megatron_ce_paired": "linear_megatron_ce"},
    "linear_ce_arm": {
        "time_vs_ce_paired": "linear_ce",
        "time_vs_megatron_ce_paired": "linear_megatron_ce",
    },
}


def _paired_ratio(times: list, others: list) -> float:
    """Median over rounds of time / other's time in the same round (each round runs every row
    once, back to back): a drift of the machine between rounds falls on both alike."""
    return statistics.median(a / b for a, b in zip(times, others, strict=True))


def _time_place_weights(labels, reps: int) -> float:
    dm.place_weights(labels, VOCAB)
    times = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        dm.place_weights(labels, VOCAB)
        if labels.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _spawn(case, phase, reps, names, threads=None):
    from del_megatron.cpu.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = (case["tp"], free_port(), case, phase, reps, names, queue, threads)
    mp.spawn(_worker, args=args, nprocs=case["tp"])
    return queue.get()


def run_case(case, reps, names=(), threads=None):
    """{impl: {time_s, time_min_s, forward_s, backward_s, peak_mib}} for one case."""
    rows = _spawn(case, "time", reps, names, threads)
    if case["device"] == "cpu":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        try:
            memory = _spawn(case, "memory", reps, names, threads)
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        for name, row in memory.items():
            rows[name].update(row)
    return rows


def _ratios(rows, reference: str, time_key="time_ratio", peak_key="peak_ratio"):
    """Each row's time and peak over the reference row's (when it ran)."""
    ref = rows.get(reference, {})
    for row in rows.values():
        if "time_s" in row and "time_s" in ref:
            row[time_key] = row["time_s"] / ref["time_s"]
        if "peak_mib" in row and "peak_mib" in ref:
            row[peak_key] = row["peak_mib"] / ref["peak_mib"]
        if "accumulator_mib" in row and "peak_mib" in row:
            row["accumulator_share"] = row["accumulator_mib"] / row["peak_mib"]
    if "place_weights" in rows and "del" in rows:
        rows["place_weights"]["share_of_del"] = (
            rows["place_weights"]["time_s"] / rows["del"]["time_s"]
        )


def _or_nan(value) -> float:
    return float("nan") if value is None else value


def _print_row(case, name, row):
    fields = [f"{case['tokens']:>6} {case['vocab']:>7} {case['tp']:>2} {case['dtype']:>5}"]
    if "hidden" in case:
        name = f"{name} h{case['hidden']}"
    fields.append(f"{name:>20}")
    fields.append(f"{row.get('time_s', float('nan')) * 1e3:>9.1f}")
    # with --linear and no linear_materialised row: the ratios against linear_megatron_ce
    time_ratio = row.get("time_ratio", row.get("time_vs_megatron_ce", row.get("share_of_del")))
    peak_ratio = row.get("peak_ratio", row.get("peak_vs_megatron_ce"))
    fields.append(f"{_or_nan(time_ratio):>7.3f}")
    fields.append(f"{row.get('peak_mib', float('nan')):>9.1f} {_or_nan(peak_ratio):>7.3f}")
    if "accumulator_share" in row:
        fields.append(
            f"({row['weight_gradient']}: accumulator {row['accumulator_mib']:.0f} MiB, "
            f"{row['accumulator_share']:.2f})"
        )
    print(" ".join(fields), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 151936])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--impls", nargs="*", default=[], help="only these rows")
    parser.add_argument("--linear", action="store_true", help="the logits-free path instead")
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=[512], help="h of the output layer (--linear)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--threads", type=int, help="CPU threads a rank (default: the CPUs over the ranks)"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/bench_loss.json")
    args = parser.parse_args(argv)

    results = []
    print(
        f"{'tokens':>6} {'vocab':>7} {'tp':>2} {'dtype':>5} {'impl':>20} "
        f"{'time ms':>9} {'x ref':>7} {'peak MiB':>9} {'x ref':>7}"
    )
    grid = itertools.product(
        args.tokens, args.vocab, args.hidden if args.linear else [None], args.tp, args.dtype
    )
    for tokens, vocab, hidden, tp, dtype in grid:
        case = {"tokens": tokens, "vocab": vocab, "tp": tp, "dtype": dtype}
        case["device"] = args.device
        if args.linear:
            case["hidden"] = hidden
        rows = run_case(case, args.reps, args.impls, args.threads)
        if args.linear:
            _add_routes(rows, case)
        reference = "linear_materialised" if args.linear else "megatron_ce"
        _ratios(rows, reference)
        if args.linear:
            _ratios(rows, "linear_megatron_ce", "time_vs_megatron_ce", "peak_vs_megatron_ce")
        for name, row in rows.items():
            kernel = None if args.linear else kernel_of(name, case)
            results.append({**case, "impl": name, **({"kernel": kernel} if kernel else {}), **row})
            _print_row(case, name, row)
        _write(args, results)  # after every case: a long grid keeps what it has
    print(f"wrote {args.json}")


def _add_routes(rows, case) -> None:
    """Each logits-free row's weight-gradient route and its fp32 [V/tp, h] accumulator (0 on
    the "backward" route)."""
    from del_megatron.kernels.linear import resolve_weight_gradient

    for name, asked in {**LINEAR_ROUTES, "linear_ce": "auto", "linear_ce_arm": "auto"}.items():
        if name in rows:
            dtype, tokens, hidden = DTYPES[case["dtype"]], case["tokens"], case["hidden"]
            local = case["vocab"] // case["tp"]
            route = resolve_weight_gradient(asked, tokens, local, hidden, dtype)
            accumulator = 4 * (case["vocab"] // case["tp"]) * hidden if route == "forward" else 0
            rows[name].update(weight_gradient=route, accumulator_mib=accumulator / 2**20)


def _write(args, results) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "reps": args.reps}
    if args.device == "cpu":
        meta["threads"] = args.threads or "cpus / tp"
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
