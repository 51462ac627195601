"""Is the CUDA path correct and fast? One process, stages isolated, every result written as it
completes. `bash benchmarks/gpu_check.sh` runs it (under 10 minutes on one H200) and prints the
summary; `--cpu` runs every stage at toy sizes on the CPU (CI: tests/test_gpu_check.py).

    python benchmarks/gpu_check.py --out benchmarks/results          # a GPU
    python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check         # toy sizes, CPU
    python benchmarks/gpu_check.py --summary benchmarks/results/gpu_check.jsonl

Stages (STAGES): environment (GPU, torch, TE, NCCL, TF32, CUDA_DEVICE_MAX_CONNECTIONS, HBM
peak); correctness (numerical_lm_loss at N 16384 and 4093, V 151936, N x V > 2^31, bf16 and
strict fp32, against Megatron's vocab_parallel_cross_entropy and, on a 256-row slice, the fp64
reference); logits_free (numerical_linear_loss against the materialised path at h 4096, both
routes); speed (forward and backward apart, CUDA events, inputs made outside the timed region,
against Megatron's CE, its fused CE and TE's parallel CE; achieved bytes/s against the traffic
floor and HBM peak); memory (peak against the same and against the logits+gradient floor);
syncs (torch.cuda.set_sync_debug_mode and benchmarks/host_syncs.py); recompiles (graphs over
several N); cuda_graph (one capture of a forward + backward); integration (Megatron-LM's
pretrain_gpt.py through the drop-in, logits-free on and off, when MEGATRON_LM_DIR is set).

Each result is one JSON line in OUT/gpu_check.jsonl: {"stage", "check", "ok", ...}; "ok" is
true, false, or null for a figure with no pass mark (and for a stage that is skipped, with
"skipped": why). A stage that raises writes one row with ok false and the error, and the next
stage runs. Needs torch, megatron-core and del_megatron only (Transformer Engine when present).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import bench_loss  # noqa: E402
from host_syncs import HostSyncs  # noqa: E402

import del_megatron as dm  # noqa: E402
from del_megatron.reference import reference_lm_loss  # noqa: E402

STAGES = (
    "environment",
    "correctness",
    "logits_free",
    "speed",
    "memory",
    "syncs",
    "recompiles",
    "cuda_graph",
    "integration",
)
VOCAB = bench_loss.VOCAB  # digits 15..24, decimal point 13
OTHER = 30  # a token id that is no digit and no decimal point
ALPHA = 0.5
# HBM peak bytes/s by device name (the first name part that matches), where the device
# properties do not give the memory clock.
HBM_PEAK = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100": 3.35e12, "H800": 3.35e12}
HBM_PEAK.update({"GH200": 4.0e12, "B200": 8.0e12, "B100": 8.0e12, "A100": 2.0e12})


@dataclass(frozen=True)
class Sizes:
    """What each stage runs at: the GPU sizes, or toy ones for --cpu."""

    tokens: Sequence[int]  # correctness: N 16384 (N x V > 2^31) and an odd N
    vocab: int
    reference_rows: int  # the slice checked against the fp64 reference
    linear_tokens: int
    linear_hidden: int
    speed_cases: Sequence[tuple]  # (tokens, vocab)
    reps: int
    recompile_tokens: Sequence[int]
    integration: dict


GPU_SIZES = Sizes(
    tokens=(16384, 4093),
    vocab=151936,
    reference_rows=256,
    linear_tokens=4096,
    linear_hidden=4096,
    speed_cases=((16384, 151936), (4096, 151936), (16384, 32000)),
    reps=5,
    recompile_tokens=(4096, 4093, 1, 8192),
    integration=dict(timeout_s=150, iterations=5),
)
CPU_SIZES = Sizes(
    tokens=(256, 129),
    vocab=2000,
    reference_rows=64,
    linear_tokens=128,
    linear_hidden=32,
    speed_cases=((512, 8000),),
    reps=1,
    recompile_tokens=(64, 63, 128),
    integration=dict(timeout_s=300, iterations=3),
)

# Tolerances, relative to the largest magnitude compared.
VALUE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # bf16 gradients: 1 ulp of the largest
LINEAR_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
TF32_TOL = 2e-3  # fp32 matmuls where TF32 cannot be turned off (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)


class Results:
    """Rows written as they come: printed, and appended to the JSON lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self.rows: List[dict] = []

    def add(self, stage: str, check: str, ok: Optional[bool], **fields) -> dict:
        row = {"stage": stage, "check": check, "ok": ok, **fields}
        self.rows.append(row)
        line = json.dumps(row, default=_jsonable)
        print(line, flush=True)
        with self.path.open("a") as fh:
            fh.write(line + "\n")
        return row


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    return repr(value)


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: Optional[float]):
    """SIGALRM after `seconds`: StageTimeout at the next Python line of the stage."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise StageTimeout(f"stage over its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- set-up -----------------------------------------------------------------------------------


class Context:
    """What the stages share: device, sizes, results, the world-1 process group with Megatron's
    parallel state, and the numbers the environment stage found (HBM peak, TF32 override)."""

    def __init__(self, device: torch.device, sizes: Sizes, results: Results, out: Path):
        self.device, self.sizes, self.results, self.out = device, sizes, results, out
        self.cuda = device.type == "cuda"
        self.hbm_peak: Optional[float] = None
        self.tf32_forced = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
        self.group = None

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _init_megatron(ctx: Context) -> None:
    """A process group of one rank and Megatron's parallel state at TP 1 (Megatron's CE reads
    its group there)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from del_megatron.ports import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if ctx.cuda else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    ctx.group = parallel_state.get_tensor_model_parallel_group()


def _labels(tokens: int, vocab: int, device, seed: int = 0, boundary: Optional[int] = None):
    """[1, tokens]: about 15% digits, some decimal points, some ignored; at `boundary - 1` a
    plain token, so that no number runs across the first `boundary` positions' end."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(OTHER, vocab, (1, tokens), generator=gen)
    pick = torch.rand(1, tokens, generator=gen)
    digits = torch.randint(15, 25, (1, tokens), generator=gen)
    labels = torch.where(pick < 0.15, digits, labels)
    labels = torch.where((pick >= 0.15) & (pick < 0.18), torch.full_like(labels, 13), labels)
    labels = torch.where(pick > 0.97, torch.full_like(labels, -100), labels)
    if boundary is not None:
        labels[0, boundary - 1] = OTHER
    return labels.to(device)


def _logits(tokens: int, vocab: int, dtype, device, seed: int = 0) -> torch.Tensor:
    """[tokens, 1, vocab] with magnitudes up to about 30, made on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, 1, vocab, generator=gen, device=device, dtype=torch.float32)
    return logits.mul_(6.0).to(dtype)


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in fp64 on the CPU)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).abs().max() / e.abs().max().clamp(min=1e-30)).item()


def _rel_on_device(
    actual: torch.Tensor, expected: torch.Tensor, keep: Optional[torch.Tensor] = None
) -> float:
    """_rel for big tensors, on their device (in fp32, one block of rows at a time); keep
    (bool, the leading dimensions of the tensors): the rows compared, others are zeroed."""
    worst, scale = 0.0, 0.0
    rows = max(1, 2**28 // max(1, expected[0].numel()))
    for start in range(0, expected.size(0), rows):
        e = expected[start : start + rows].float()
        a = actual[start : start + rows].float()
        if keep is not None:
            kept = keep[start : start + rows].reshape(
                *e.shape[: keep.dim()], *[1] * (e.dim() - keep.dim())
            )
            e, a = e * kept, a * kept
        worst = max(worst, (a - e).abs().max().item())
        scale = max(scale, e.abs().max().item())
    return worst / max(scale, 1e-30)


# ---- stages -----------------------------------------------------------------------------------


def stage_environment(ctx: Context) -> None:
    info: Dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_override_env": {
            k: os.environ[k]
            for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
            if k in os.environ
        },
        "torch_compile_disable": os.environ.get("TORCH_COMPILE_DISABLE"),
    }
    for name in ("megatron.core", "transformer_engine", "del_megatron"):
        info[name] = _version_of(name)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        info.update(capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        ctx.hbm_peak = _hbm_peak(props)
        info["hbm_peak_tb_s"] = None if ctx.hbm_peak is None else round(ctx.hbm_peak / 1e12, 2)
    else:
        info.update(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count())
    ctx.results.add("environment", "environment", None, **info)


def _version_of(module: str) -> Optional[str]:
    try:
        imported = __import__(module, fromlist=["__version__"])
    except Exception:  # not installed, or broken: reported as absent
        return None
    return str(getattr(imported, "__version__", "?"))


def _hbm_peak(props) -> Optional[float]:
    """Peak HBM bytes/s: from the memory clock and bus width where torch reports them (double
    data rate), else by device name."""
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8
    for name, peak in HBM_PEAK.items():
        if name in props.name:
            return peak
    return None


@contextlib.contextmanager
def _strict_fp32():
    """fp32 matmuls without TF32 (as far as torch can turn it off)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _megatron_ce(logits: torch.Tensor, labels: torch.Tensor):
    """Megatron's vocab_parallel_cross_entropy [b, s] and its logits gradient."""
    from megatron.core import tensor_parallel

    leaf = logits.detach().clone().requires_grad_(True)
    target = labels.clamp(min=0).t().contiguous()  # Megatron's CE knows no ignore_index
    ce = tensor_parallel.vocab_parallel_cross_entropy(leaf, target).t()
    (grad,) = torch.autograd.grad(ce.sum(), leaf)
    return ce.detach(), grad


def _ours(logits, labels, cfg, kernel: str):
    leaf = logits.detach().clone().requires_grad_(True)
    loss = dm.numerical_lm_loss(labels, leaf, cfg, kernel=kernel)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


def stage_correctness(ctx: Context) -> None:
    """numerical_lm_loss against Megatron's CE (values and gradients, loss "ce") and against
    the fp64 reference on a slice (loss "del", with its digit term)."""
    sizes, vocab = ctx.sizes, ctx.sizes.vocab
    kernels = ("auto", "recompute", "softmax")
    for tokens, dtype in itertools.product(sizes.tokens, (torch.bfloat16, torch.float32)):
        labels = _labels(tokens, vocab, ctx.device, seed=tokens, boundary=sizes.reference_rows)
        logits = _logits(tokens, vocab, dtype, ctx.device, seed=tokens)
        case = dict(tokens=tokens, vocab=vocab, dtype=dtype, n_times_v=tokens * vocab)
        with _strict_fp32():
            ce_want, ce_grad_want = _megatron_ce(logits, labels)
            valid = (labels != -100).t()
            for kernel in kernels if tokens == sizes.tokens[0] else ("auto",):
                cfg = dm.NumericalLossConfig(loss="ce", vocab=VOCAB)
                ce, grad = _ours(logits, labels, cfg, kernel)
                # Megatron's CE has no ignore_index: ignored rows are left out
                value_error = _rel(ce[labels != -100], ce_want[labels != -100])
                grad_error = _rel_on_device(grad, ce_grad_want, keep=valid)
                ok = value_error < VALUE_TOL[dtype] and grad_error < GRAD_TOL[dtype]
                ctx.results.add(
                    "correctness",
                    f"ce vs Megatron CE, kernel {kernel}",
                    ok,
                    **case,
                    kernel=_kernel_taken(kernel, logits),
                    value_error=value_error,
                    grad_error=grad_error,
                )
                del grad
                ctx.free()
            del ce_grad_want
            ctx.free()
            _check_against_reference(ctx, logits, labels, case)
        del logits
        ctx.free()


def _kernel_taken(kernel: str, logits: torch.Tensor) -> str:
    from del_megatron.kernels import resolve_kernel

    return resolve_kernel(kernel, logits, inplace=False)


def _check_against_reference(ctx: Context, logits, labels, case) -> None:
    """DEL (digit term included) on the full sequence, checked on its first reference_rows
    positions against reference_lm_loss in fp64 on the CPU: values and logits gradients."""
    rows = ctx.sizes.reference_rows
    for reduction in ("token", "digit"):
        cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction)
        loss, grad = _ours(logits, labels, cfg, "auto")
        head = logits[:rows].detach().cpu().double().requires_grad_(True)
        ce, term = reference_lm_loss(labels[:, :rows].cpu(), head, VOCAB, loss="del")
        if reduction == "digit":  # the term scaled by the whole sequence's tokens / digits
            full = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
            term = term * (full.n_tokens.double() / full.n_digits.double()).item()
        total = ce + ALPHA * term
        (grad_want,) = torch.autograd.grad(total.sum(), head)
        value_error = _rel(loss[:, :rows], total)
        grad_error = _rel(grad[:rows], grad_want)
        dtype = case["dtype"]
        ok = value_error < 1e-5 and grad_error < GRAD_TOL[dtype]
        ctx.results.add(
            "correctness",
            f"del ({reduction}) vs fp64 reference, {rows} rows",
            ok,
            **case,
            kernel=_kernel_taken("auto", logits),
            value_error=value_error,
            grad_error=grad_error,
        )
        del grad
        ctx.free()


def stage_logits_free(ctx: Context) -> None:
    """numerical_linear_loss (as --del-logits-free runs it: loss_mask given) against the
    materialised output layer + numerical_lm_loss: loss, grad of hidden and of weight, every
    weight-gradient route, bf16 and strict fp32."""
    tokens, h, vocab = ctx.sizes.linear_tokens, ctx.sizes.linear_hidden, ctx.sizes.vocab
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    labels = _labels(tokens, vocab, ctx.device, seed=5)
    mask = (labels != -100).float()
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    hidden32 = torch.randn(tokens, 1, h, generator=gen, device=ctx.device)
    weight32 = torch.randn(vocab, h, generator=gen, device=ctx.device) / h**0.5 * 4
    for dtype in (torch.bfloat16, torch.float32):
        hidden, weight = hidden32.to(dtype), weight32.to(dtype)
        tolerance = TF32_TOL if dtype == torch.float32 and ctx.tf32_forced else LINEAR_TOL[dtype]
        with _strict_fp32():
            want = _linear_grads(hidden, weight, labels, mask, cfg, None)
            for route in ("auto", "forward", "backward"):
                got = _linear_grads(hidden, weight, labels, mask, cfg, route)
                errors = {
                    k: _rel_on_device(g, w)
                    for k, g, w in zip(
                        ("value", "grad_hidden", "grad_weight"), got, want, strict=True
                    )
                }
                ctx.results.add(
                    "logits_free",
                    f"logits-free vs materialised, route {route}",
                    max(errors.values()) < tolerance,
                    tokens=tokens,
                    hidden=h,
                    vocab=vocab,
                    dtype=dtype,
                    tf32_forced=ctx.tf32_forced and dtype == torch.float32,
                    **{f"{k}_error": v for k, v in errors.items()},
                )
                del got
                ctx.free()
        del want
        ctx.free()
    _check_sink_product(ctx)


def _check_sink_product(ctx: Context) -> None:
    """The weight-gradient sink's exact product (Megatron's fp32 main_grad += grad.t() @ hidden,
    bf16 operands): which way the device forms it (kernels.linear.exact_product_route: one
    GEMM with fp32 output on CUDA where torch has it, else the operands upcast to fp32), its
    error against the fp64 product, and on CUDA the time of each way."""
    from del_megatron.kernels import linear

    tokens, h = ctx.sizes.linear_tokens, ctx.sizes.linear_hidden
    columns = min(ctx.sizes.vocab, 4 * h)
    gen = torch.Generator(device=ctx.device).manual_seed(9)
    grad_t = torch.randn(columns, tokens, generator=gen, device=ctx.device).bfloat16()
    hidden = torch.randn(tokens, h, generator=gen, device=ctx.device).bfloat16()
    route = linear.exact_product_route(ctx.device, torch.bfloat16, torch.float32)
    accumulator = torch.zeros(columns, h, device=ctx.device)
    with _strict_fp32():
        linear._add_product_(accumulator, grad_t, hidden, exact=True)
        want = torch.matmul(grad_t.double(), hidden.double())
        error = _rel_on_device(accumulator, want)
        del want
        times = {}
        if ctx.device.type == "cuda":
            upcast = (grad_t.float(), hidden.float())
            for name, run in (
                ("fp32-output GEMM", lambda: torch.mm(grad_t, hidden, out_dtype=torch.float32)),
                ("upcast", lambda: torch.mm(*upcast)),
            ):
                if name == "upcast" or linear.fp32_output_gemm(ctx.device):
                    run()
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    for _ in range(ctx.sizes.reps):
                        run()
                    end.record()
                    end.synchronize()
                    times[f"{name} ms"] = start.elapsed_time(end) / ctx.sizes.reps
    ctx.results.add(
        "logits_free",
        "weight-gradient sink product (bf16 into fp32) vs fp64",
        error < (TF32_TOL if ctx.tf32_forced and route == "upcast" else 1e-5),
        route=route,
        shape=[columns, tokens, h],
        error=error,
        **times,
    )
    ctx.free()


def _linear_grads(hidden, weight, labels, mask, cfg, route):
    """(loss, grad hidden, grad weight); route None: the materialised path."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    if route is None:
        loss = dm.numerical_lm_loss(labels, torch.matmul(h, w.t()), cfg)
    else:
        loss = dm.numerical_linear_loss(h, w, labels, cfg, loss_mask=mask, weight_gradient=route)
    grads = torch.autograd.grad((loss * mask).sum(), (h, w))
    return (loss.detach(), *grads)


SPEED_IMPLS = (
    "megatron_ce", "megatron_fused", "te_ce", "del", "del_recompute", "del_softmax",
    "del_compiled", "ce",
)  # fmt: skip
REFERENCES = ("megatron_ce", "megatron_fused", "te_ce")


def stage_speed_and_memory(ctx: Context) -> None:
    """Per case and implementation: forward and backward time (median of reps, inputs made
    before the clock starts), ratios against the references, achieved bytes/s against the
    traffic floor (bf16: 2 B a logit read in forward, 4 B read + written in backward) and its
    share of HBM peak; peak memory against the references and the logits + gradient floor."""
    if not ctx.cuda:
        _serve_big_buffers_by_mmap()
    for tokens, vocab in ctx.sizes.speed_cases:
        case = {
            "tokens": tokens,
            "vocab": vocab,
            "tp": 1,
            "dtype": "bf16",
            "device": ctx.device.type,
        }
        impls = bench_loss.loss_implementations("bf16", 1, ctx.group, ctx.device)
        impls = {name: impls[name] for name in SPEED_IMPLS if name in impls}
        if ctx.cuda:  # "del" takes the compiled kernel there
            impls.pop("del_compiled", None)
        else:  # toy sizes: Megatron's own compiled CE would only add its compile time
            impls.pop("megatron_fused", None)
        make = bench_loss._make_inputs(case, 0, 1, ctx.device)
        meter = bench_loss.Meter(ctx.device)
        measured = {name: [] for name in impls}
        peak = {}
        for name, fn in impls.items():
            bench_loss._one_step(fn, make, meter)  # warm-up, compilation
            peak[name] = bench_loss._one_step(fn, make, meter)[-1]
        for rep in range(ctx.sizes.reps):
            order = list(impls)[rep % len(impls) :] + list(impls)[: rep % len(impls)]
            for name in order:
                measured[name].append(bench_loss._one_step(impls[name], make, meter)[:2])
        _speed_rows(ctx, case, measured, peak)
        ctx.free()


def _speed_rows(ctx: Context, case: dict, measured: dict, peak: dict) -> None:
    logits = case["tokens"] * case["vocab"]
    floor_bytes = 2 * logits * 2  # bf16 logits and their gradient
    forward_traffic, backward_traffic = 2 * logits, 4 * logits
    times = {
        name: (
            statistics.median(f for f, _ in runs),
            statistics.median(b for _, b in runs),
        )
        for name, runs in measured.items()
    }
    for name, (fwd, bwd) in times.items():
        row = dict(case, impl=name, forward_ms=fwd * 1e3, backward_ms=bwd * 1e3)
        if name in ("del", "ce"):
            row["kernel"] = bench_loss.kernel_of(name, case)
        row["forward_gb_s"] = forward_traffic / fwd / 1e9
        row["backward_gb_s"] = backward_traffic / bwd / 1e9
        row["gb_s"] = (forward_traffic + backward_traffic) / (fwd + bwd) / 1e9
        if ctx.hbm_peak:
            row["hbm_share"] = row["gb_s"] * 1e9 / ctx.hbm_peak
        for ref in REFERENCES:
            if ref in times and ref != name and sum(times[ref]) > 0:
                row[f"time_vs_{ref}"] = (fwd + bwd) / sum(times[ref])
        ctx.results.add("speed", f"{name} {case['tokens']} x {case['vocab']}", None, **row)
    for name, bytes_ in peak.items():
        row = dict(case, impl=name, peak_mib=bytes_ / 2**20, vs_floor=bytes_ / floor_bytes)
        for ref in REFERENCES:
            if ref in peak and ref != name and peak[ref] > 0:
                row[f"peak_vs_{ref}"] = bytes_ / peak[ref]
        ok = None
        # The kernels that keep the logits, not an fp32 softmax: at most Megatron's peak.
        if name in ("del", "ce", "del_recompute", "del_compiled") and "peak_vs_megatron_ce" in row:
            ok = row["peak_vs_megatron_ce"] <= 1.0
        ctx.results.add("memory", f"{name} {case['tokens']} x {case['vocab']}", ok, **row)


def _serve_big_buffers_by_mmap() -> None:
    """CPU: glibc serves every buffer over 64 KiB by mmap, so that a freed buffer leaves the
    resident set and the peak-RSS meter sees each step alone (as bench_loss.py's memory runs)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def _sync_cases(ctx: Context):
    """(name, fn) of one forward + backward each: the materialised kernels, THD, the "digit"
    reduction, and the logits-free path on both routes."""
    tokens, vocab = ctx.sizes.speed_cases[0]
    labels = _labels(tokens, vocab, ctx.device, seed=9)
    logits = _logits(tokens, vocab, torch.bfloat16, ctx.device, seed=9)
    cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32, device=ctx.device)
    h = ctx.sizes.linear_hidden
    gen = torch.Generator(device=ctx.device).manual_seed(9)
    hidden = torch.randn(tokens, 1, h, generator=gen, device=ctx.device).to(torch.bfloat16)
    weight = (torch.randn(vocab, h, generator=gen, device=ctx.device) / h**0.5).to(torch.bfloat16)
    mask = torch.ones(labels.shape, device=ctx.device)

    def lm(kernel, reduction="token", cu_seqlens=None):
        cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction)

        def run():
            leaf = logits.detach().requires_grad_(True)
            loss = dm.numerical_lm_loss(labels, leaf, cfg, kernel=kernel, cu_seqlens=cu_seqlens)
            torch.autograd.grad(loss.sum(), leaf)

        return run

    def linear(route):
        cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)

        def run():
            hh, ww = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            loss = dm.numerical_linear_loss(
                hh, ww, labels, cfg, loss_mask=mask, weight_gradient=route
            )
            torch.autograd.grad((loss * mask).sum(), (hh, ww))

        return run

    return [
        ("numerical_lm_loss auto", lm("auto")),
        ("numerical_lm_loss recompute", lm("recompute")),
        ("numerical_lm_loss auto, digit reduction", lm("auto", "digit")),
        ("numerical_lm_loss auto, THD", lm("auto", cu_seqlens=cu)),
        ("numerical_linear_loss forward route", linear("forward")),
        ("numerical_linear_loss backward route", linear("backward")),
    ]


def stage_syncs(ctx: Context) -> None:
    """One forward + backward of each case after a warm-up: on CUDA the syncs CUDA itself
    reports (torch.cuda.set_sync_debug_mode), on every device the causes HostSyncs finds."""
    for name, run in _sync_cases(ctx):
        run()
        ctx.synchronize()
        cuda_syncs = None
        if ctx.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            cuda_syncs = [
                str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)
            ]
        with HostSyncs() as syncs:
            run()
        count = len(syncs.events) + (len(cuda_syncs) if cuda_syncs else 0)
        ctx.results.add(
            "syncs",
            name,
            count == 0,
            cuda_reported=None if cuda_syncs is None else len(cuda_syncs),
            causes=len(syncs.events),
            where=sorted({str(e) for e in syncs.events}),
            cuda_messages=sorted(set(cuda_syncs or [])),
        )
    ctx.free()


def stage_recompiles(ctx: Context) -> None:
    """Graphs Dynamo holds after compiled-kernel calls (bf16) at several N, with and without
    grad: a call may add graphs only where it is the first of its grad mode (a guard) or has
    N = 1 (which Dynamo specialises); other N reuse the dynamic-shape graphs."""
    from torch._dynamo.utils import counters

    vocab = ctx.sizes.speed_cases[0][1]
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    sizes = ctx.sizes.recompile_tokens
    calls = [(n, True) for n in sizes] + [(n, False) for n in sizes if n != 1][:2]
    seen, before = [], counters["stats"]["unique_graphs"]
    for tokens, grad in calls:
        labels = _labels(tokens, vocab, ctx.device, seed=tokens)
        logits = _logits(tokens, vocab, torch.bfloat16, ctx.device).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss = dm.numerical_lm_loss(labels, logits, cfg, kernel="compiled")
            if grad:
                torch.autograd.grad(loss.sum(), logits)
        now = counters["stats"]["unique_graphs"]
        seen.append({"tokens": tokens, "grad": grad, "new_graphs": now - before})
        before = now
    modes = set()
    unexpected = []
    for call in seen:
        first_of_mode = call["grad"] not in modes
        modes.add(call["grad"])
        if call["new_graphs"] and not first_of_mode and call["tokens"] != 1:
            unexpected.append(call)
    ctx.results.add(
        "recompiles",
        "compiled kernel over several N",
        not unexpected,
        calls=seen,
        new_graphs_per_call=[c["new_graphs"] for c in seen],
        unexpected=unexpected,
    )


def stage_cuda_graph(ctx: Context) -> None:
    """One capture of numerical_lm_loss forward + backward (the compiled kernel) into a CUDA
    graph, replayed once and compared with the eager step."""
    if not ctx.cuda:
        ctx.results.add("cuda_graph", "capture forward + backward", None, skipped="needs CUDA")
        return
    tokens, vocab = 4096, ctx.sizes.speed_cases[0][1]
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    labels = _labels(tokens, vocab, ctx.device, seed=3)
    logits = _logits(tokens, vocab, torch.bfloat16, ctx.device, seed=3).requires_grad_(True)

    def step():
        loss = dm.numerical_lm_loss(labels, logits, cfg)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        return loss, grad

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            want = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            got = step()
        graph.replay()
        torch.cuda.synchronize()
        error = max(_rel(got[0], want[0]), _rel_on_device(got[1], want[1]))
        ctx.results.add(
            "cuda_graph", "capture forward + backward", error < 1e-6, replay_error=error
        )
    except Exception as exc:  # the capture's failure is the finding
        ctx.results.add(
            "cuda_graph",
            "capture forward + backward",
            False,
            error=f"{type(exc).__name__}: {exc}"[:500],
        )


# ---- integration: Megatron-LM's pretrain_gpt.py -------------------------------------------------

INTEGRATION_MODEL = [
    "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant", "--seed", "1234",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "151936",
    "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1",
    "--position-embedding-type", "rope", "--use-distributed-optimizer", "--bf16",
    "--numerical-loss", "del", "--del-alpha", "0.01",
    "--del-digit-token-ids", *[str(i) for i in range(10, 20)],
]  # fmt: skip
GPU_INTEGRATION = ["--transformer-impl", "transformer_engine"]  # gradient-accumulation fusion on
CPU_INTEGRATION = [
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128",
]  # fmt: skip


def integration_commands(ctx: Context, megatron_lm: Path) -> Dict[str, List[str]]:
    """The two torchrun command lines (logits-free off and on) of the integration stage."""
    iterations = str(ctx.sizes.integration["iterations"])
    flags = INTEGRATION_MODEL + (GPU_INTEGRATION if ctx.cuda else CPU_INTEGRATION)
    flags = flags + ["--train-iters", iterations]
    runs = {}
    for name, extra in (("materialised", []), ("logits_free", ["--del-logits-free"])):
        grads = ctx.out / f"integration_{name}_main_grad.pt"
        runs[name] = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--master-port", str(_free_port()), str(HERE / "gpu_integration.py"), str(grads),
            str(ROOT / "examples" / "pretrain_gpt_del.py"), *flags, *extra,
        ]  # fmt: skip
    return runs


def _free_port() -> int:
    from del_megatron.ports import free_port

    return free_port()


def parse_lm_loss(log: str) -> Dict[int, float]:
    """{iteration: lm loss} from Megatron-LM's training log."""
    import re

    found = {}
    for match in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eE]+)", log):
        found[int(match[1])] = float(match[2])
    return found


def compare_integration(losses: Dict[str, Dict[int, float]], grads: Dict[str, torch.Tensor]):
    """(ok, figures): lm loss of every iteration within 2% (iteration 1 within 0.1%), and the
    output weight's main_grad after iteration 1 within 5% in norm of the difference."""
    want, got = losses["materialised"], losses["logits_free"]
    loss_errors = {i: abs(got[i] - want[i]) / abs(want[i]) for i in want if i in got}
    grad_error = (grads["logits_free"] - grads["materialised"]).norm() / grads[
        "materialised"
    ].norm()
    ok = (
        bool(want)
        and sorted(want) == sorted(got)
        and loss_errors.get(1, 1.0) < 1e-3
        and max(loss_errors.values()) < 2e-2
        and grad_error.item() < 5e-2
    )
    figures = dict(
        lm_loss=want,
        lm_loss_logits_free=got,
        lm_loss_rel_error=loss_errors,
        main_grad_rel_error=grad_error.item(),
        main_grad_norm=grads["materialised"].norm().item(),
        main_grad_norm_logits_free=grads["logits_free"].norm().item(),
    )
    return ok, figures


def stage_integration(ctx: Context) -> None:
    """Megatron-LM's pretrain_gpt.py (through examples/pretrain_gpt_del.py) with the TE spec,
    bf16, gradient-accumulation fusion, the distributed optimizer, MTP, an untied output layer
    and V 151936, logits-free off and on: lm loss per iteration and the output weight's
    main_grad after iteration 1 (gpu_integration.py saves it) must agree."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if not checkout:
        ctx.results.add(
            "integration",
            "pretrain_gpt.py logits-free on and off",
            None,
            skipped="set MEGATRON_LM_DIR to a Megatron-LM checkout to run it",
            commands={
                k: " ".join(v)
                for k, v in integration_commands(ctx, Path("<MEGATRON_LM_DIR>")).items()
            },
        )
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_LM_DIR=checkout)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not ctx.cuda:
        from del_megatron.cpu.training import job_environment

        env = job_environment(env)
    losses, grads = {}, {}
    for name, command in integration_commands(ctx, Path(checkout)).items():
        done = subprocess.run(
            command,
            cwd=checkout,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=ctx.sizes.integration["timeout_s"],
        )
        log_path = ctx.out / f"integration_{name}.log"
        log_path.write_text(done.stdout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{name} run exited {done.returncode}; see {log_path}: {done.stdout[-1500:]}"
            )
        losses[name] = parse_lm_loss(done.stdout)
        grads[name] = torch.load(ctx.out / f"integration_{name}_main_grad.pt")
    ok, figures = compare_integration(losses, grads)
    ctx.results.add("integration", "pretrain_gpt.py logits-free on and off", ok, **figures)


# ---- driver -----------------------------------------------------------------------------------

STAGE_FUNCTIONS: Dict[str, Callable[[Context], None]] = {
    "environment": stage_environment,
    "correctness": stage_correctness,
    "logits_free": stage_logits_free,
    "speed": stage_speed_and_memory,  # writes the memory rows too
    "syncs": stage_syncs,
    "recompiles": stage_recompiles,
    "cuda_graph": stage_cuda_graph,
    "integration": stage_integration,
}
# Seconds each stage may take on a GPU (the whole check: under 10 minutes on one H200).
GPU_LIMITS = {
    "environment": 30,
    "correctness": 120,
    "logits_free": 60,
    "speed": 150,
    "syncs": 30,
    "recompiles": 60,
    "cuda_graph": 30,
    "integration": 320,
}


def run(ctx: Context, stages: Sequence[str], limits: Dict[str, float]) -> None:
    for name in stages:
        started = time.monotonic()
        try:
            with _time_limit(limits.get(name)):
                if name != "environment" and ctx.group is None:
                    _init_megatron(ctx)
                STAGE_FUNCTIONS[name](ctx)
        except Exception as exc:  # noqa: BLE001  (a stage's failure is a result; go on)
            ctx.results.add(
                name,
                "stage",
                False,
                error=f"{type(exc).__name__}: {exc}"[:1000],
                traceback=traceback.format_exc()[-3000:],
            )
        finally:
            ctx.free()
        ctx.results.add(name, "stage time", None, seconds=round(time.monotonic() - started, 1))


# ---- summary ----------------------------------------------------------------------------------

SUMMARY_FIELDS = (
    "kernel", "value_error", "grad_error", "grad_hidden_error", "grad_weight_error",
    "forward_ms", "backward_ms", "gb_s", "hbm_share", "time_vs_megatron_ce", "time_vs_te_ce",
    "peak_mib", "peak_vs_megatron_ce", "peak_vs_te_ce", "vs_floor", "cuda_reported", "causes",
    "new_graphs_per_call", "replay_error", "main_grad_rel_error", "skipped", "error", "seconds",
)  # fmt: skip


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict) and value:
        return json.dumps(value)[:60]
    return str(value)[:80]


def summary(rows: List[dict]) -> str:
    """A Markdown table, one line per row, and the verdict: passed, failed and figures."""
    lines = ["| stage | check | ok | figures |", "|---|---|---|---|"]
    for row in rows:
        if row["stage"] == "environment" and row["check"] == "environment":
            figures = ", ".join(
                f"{k} {_cell(v)}" for k, v in row.items() if k not in ("stage", "check", "ok")
            )
        else:
            figures = ", ".join(
                f"{k} {_cell(row[k])}" for k in SUMMARY_FIELDS if row.get(k) is not None
            )
        mark = {True: "pass", False: "FAIL", None: ""}[row["ok"]]
        lines.append(f"| {row['stage']} | {row['check']} | {mark} | {figures} |")
    failed = [r for r in rows if r["ok"] is False]
    passed = [r for r in rows if r["ok"] is True]
    stages = [s for s in STAGES if not any(r["stage"] == s for r in rows)]
    verdict = f"{len(passed)} passed, {len(failed)} failed"
    if stages:
        verdict += f"; no result from: {', '.join(stages)}"
    return "\n".join(lines + ["", verdict])


def read_rows(path: Path) -> List[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--cpu", action="store_true", help="every stage at toy sizes on the CPU")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--summary", type=Path, help="print the summary of a JSON lines file")
    args = parser.parse_args(argv)
    if args.summary:
        rows = read_rows(args.summary)
        print(summary(rows))
        return 1 if any(r["ok"] is False for r in rows) or not rows else 0
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --cpu for the toy-size run)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    results = Results(args.out / "gpu_check.jsonl")
    ctx = Context(device, CPU_SIZES if args.cpu else GPU_SIZES, results, args.out)
    asked = ["speed" if s == "memory" else s for s in args.stages]  # speed writes both
    stages = ["environment"] + [s for s in STAGE_FUNCTIONS if s in asked and s != "environment"]
    run(ctx, stages, {} if args.cpu else GPU_LIMITS)
    print(summary(results.rows))
    return 1 if any(r["ok"] is False for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
