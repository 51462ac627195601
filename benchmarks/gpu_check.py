"""Is the CUDA path correct and fast? Each stage in a process of its own, killed at its time
limit with every process it started; every result written as it completes. `bash
benchmarks/gpu_check.sh` runs it (under 10 minutes on one H200) and prints the summary; `--cpu`
runs every stage at toy sizes on the CPU (CI: tests/test_gpu_check.py).

    python benchmarks/gpu_check.py --out benchmarks/results          # a GPU
    python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check         # toy sizes, CPU
    python benchmarks/gpu_check.py --summary benchmarks/results/gpu_check.jsonl

Stages, in the order they run (LIMITS_S: each one's seconds): environment (GPU, torch, TE,
NCCL, TF32, CUDA_DEVICE_MAX_CONNECTIONS, HBM peak); integration (with MEGATRON_LM_DIR set:
Megatron-LM's pretrain_gpt.py through the drop-in, logits-free off and on, digit and token
reductions, DP 2 where there are 2 GPUs or on the CPU; gpu_integration.py); correctness
(numerical_lm_loss at N 16384 and 4093, V 151936, N x V > 2^31, bf16 and strict fp32, against
Megatron's vocab_parallel_cross_entropy and, on a 256-row slice, the fp64 reference);
logits_free (numerical_linear_loss against the materialised path at h 4096, both routes);
speed (forward and backward apart, CUDA events, inputs made outside the timed region, against
Megatron's CE, its fused CE and TE's parallel CE; achieved bytes/s against the traffic floor
and HBM peak); memory (peak against the same and against the logits+gradient floor); syncs
(torch.cuda.set_sync_debug_mode and benchmarks/host_syncs.py); recompiles (graphs over several
N); cuda_graph (one capture of a forward + backward).

Each result is one JSON line in OUT/gpu_check.jsonl: {"stage", "check", "ok", ...}; "ok" is
true, false, or null for a figure with no pass mark (and for a stage that is skipped, with
"skipped": why). A stage that raises writes one row with ok false and the error; one killed at
its limit, or ended by a signal, gets that row from the driver, with the tail of its stderr
(OUT/gpu_check_<stage>.stderr, where its Python stacks are written just before the kill); the
next stage runs either way. Needs torch, megatron-core and del_megatron only (Transformer
Engine when present).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
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
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import bench_loss  # noqa: E402
import gpu_integration  # noqa: E402
from host_syncs import HostSyncs  # noqa: E402

import del_megatron as dm  # noqa: E402
from del_megatron.megatron.logits_free import MIN_CORE as MIN_LOGITS_FREE_CORE  # noqa: E402
from del_megatron.quick_exit import skip_final_collections  # noqa: E402
from del_megatron.reference import reference_lm_loss  # noqa: E402

STAGES = (
    "environment",
    "integration",
    "correctness",
    "logits_free",
    "speed",
    "memory",
    "syncs",
    "recompiles",
    "cuda_graph",
)
VOCAB = bench_loss.VOCAB  # digits 15..24, decimal point 13
OTHER = 30  # a token id that is no digit and no decimal point
ALPHA = 0.5
# The token reduction's given digit share in the kernel checks (its weight: ALPHA / share a token).
TOKEN_DIGIT_SHARE = 0.5
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
    integration_iterations: int


GPU_SIZES = Sizes(
    tokens=(16384, 4093),
    vocab=151936,
    reference_rows=256,
    linear_tokens=4096,
    linear_hidden=4096,
    speed_cases=((16384, 151936), (4096, 151936), (16384, 32000)),
    reps=5,
    recompile_tokens=(4096, 4093, 1, 8192),
    integration_iterations=5,
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
    integration_iterations=3,
)

# Tolerances, relative to the largest magnitude compared.
VALUE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # bf16 gradients: 1 ulp of the largest
LINEAR_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
TF32_TOL = 2e-3  # fp32 matmuls where TF32 cannot be turned off (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)


class Results:
    """Rows written as they come: printed, and appended to the JSON lines file."""

    def __init__(self, path: Path, fresh: bool = True) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh or not path.exists():
            path.write_text("")
        self.rows: List[dict] = []

    def add(self, stage: str, check: str, ok: Optional[bool], **fields) -> dict:
        row = {"stage": stage, "check": check, "ok": ok, **fields}
        self.rows.append(row)
        line = json.dumps(row, default=_jsonable)
        print(line, flush=True)
        with self.path.open("a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():  # after a stage killed mid-line, the row starts a line of its own
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write(line.encode() + b"\n")
        return row


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    return repr(value)


# ---- set-up -----------------------------------------------------------------------------------


class Context:
    """What the stages share: device, sizes, results, the world-1 process group with Megatron's
    parallel state, and the numbers the environment stage found (HBM peak, TF32 override)."""

    def __init__(self, device: torch.device, sizes: Sizes, results: Results, out: Path):
        self.device, self.sizes, self.results, self.out = device, sizes, results, out
        self.cuda = device.type == "cuda"
        self.hbm_peak = _hbm_peak(torch.cuda.get_device_properties(device)) if self.cuda else None
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
        info["gpus"] = torch.cuda.device_count()
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
        share = TOKEN_DIGIT_SHARE if reduction == "token" else None
        cfg = dm.NumericalLossConfig(
            loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction, digit_share=share
        )
        loss, grad = _ours(logits, labels, cfg, "auto")
        head = logits[:rows].detach().cpu().double().requires_grad_(True)
        ce, term = reference_lm_loss(labels[:, :rows].cpu(), head, VOCAB, loss="del")
        if reduction == "digit":  # the term scaled by the whole sequence's tokens / digits
            full = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
            term = term * (full.n_tokens.double() / full.n_digits.double()).item()
        total = ce + cfg.token_weight * term
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
        share = TOKEN_DIGIT_SHARE if reduction == "token" else None
        cfg = dm.NumericalLossConfig(
            loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction, digit_share=share
        )

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

INTEGRATION = "pretrain_gpt.py logits-free vs materialised"


def stage_integration(ctx: Context) -> None:
    """Megatron-LM's pretrain_gpt.py through examples/pretrain_gpt_del.py (gpu_integration.py:
    the TE spec on a GPU, bf16, gradient-accumulation fusion, the distributed optimizer with
    overlapped reduce-scatter and all-gather in small buckets, MTP, an untied output layer, V
    151936) on a corpus with numbers, at DP 2 where it can (gpu_integration.data_parallel):
    for the digit reduction, then the token one, logits-free off and on must agree in lm loss,
    DEL term and each rank's output-layer main_grad before iteration 1's optimizer step."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    ranks, why = gpu_integration.data_parallel(ctx.cuda, torch.cuda.device_count())
    iterations = ctx.sizes.integration_iterations
    data = ctx.out / "integration_data" / "numbers"
    launches = gpu_integration.commands(ctx.cuda, ranks, ctx.out, data, iterations)
    plan = dict(ranks=ranks, data_parallel=why)
    version = gpu_integration.megatron_core_version(Path(checkout)) if checkout else None
    skipped = None
    if not checkout:
        skipped = "set MEGATRON_LM_DIR to a Megatron-LM checkout to run it"
    elif version is not None and version < MIN_LOGITS_FREE_CORE:
        skipped = (
            f"--del-logits-free needs megatron-core >= {MIN_LOGITS_FREE_CORE[0]}."
            f"{MIN_LOGITS_FREE_CORE[1]}; MEGATRON_LM_DIR holds {version[0]}.{version[1]}"
        )
    if skipped:
        commands = {k: " ".join(v) for k, v in launches.items()}
        ctx.results.add(
            "integration", INTEGRATION, None, skipped=skipped, **plan, commands=commands
        )
        return
    vocab = gpu_integration.GPU_VOCAB if ctx.cuda else gpu_integration.CPU_VOCAB
    corpus = gpu_integration.write_number_corpus(data, vocab, tokens=100_000)
    ctx.results.add("integration", "corpus with numbers", corpus["digit_share"] > 0.2, **corpus)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_LM_DIR=checkout)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not ctx.cuda:
        from del_megatron.cpu.training import job_environment

        env = job_environment(env)
    for reduction in gpu_integration.REDUCTIONS:
        try:
            names = {run: f"{reduction}_{run}" for run in gpu_integration.RUNS}
            ran = _run_together({n: launches[n] for n in names.values()}, checkout, env, ctx.out)
            logs = {run: gpu_integration.parse_log(ran[name][0]) for run, name in names.items()}
            grads = {
                run: [
                    torch.load(ctx.out / f"integration_{name}_main_grad.rank{r}.pt")
                    for r in range(ranks)
                ]
                for run, name in names.items()
            }
            ok, figures = gpu_integration.compare(logs, grads, iterations)
            figures["run_seconds"] = {run: ran[name][1] for run, name in names.items()}
        except (RuntimeError, OSError, KeyError) as exc:  # a run failed; the next one runs
            ok, figures = False, {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        ctx.results.add(
            "integration",
            f"{INTEGRATION}, {reduction} reduction",
            ok,
            reduction=reduction,
            **plan,
            **figures,
        )


def _run_together(
    launches: Dict[str, List[str]], checkout: str, env: Dict[str, str], out: Path
) -> Dict[str, Tuple[str, float]]:
    """Run the torchrun commands at the same time (each a free port, its output in
    OUT/integration_<name>.log as it comes, stale gradient files removed first) from the
    checkout: the two runs of a pair are independent jobs, and on a GPU most of a run is
    start-up and compiling on the host. Returns {name: (log, seconds)}; RuntimeError with the
    tail of each failed run's log."""
    running = {}
    started = time.monotonic()
    for name, command in launches.items():
        for stale in out.glob(f"integration_{name}_main_grad.rank*.pt"):
            stale.unlink()
        command = [str(_free_port()) if arg == gpu_integration.PORT else arg for arg in command]
        log_path = out / f"integration_{name}.log"
        print(f"integration: {name} starts, log {log_path}", flush=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=log, stderr=log)
        running[name] = (proc, log_path)
    seconds = {}
    while len(seconds) < len(running):
        for name, (proc, _) in running.items():
            if name not in seconds and proc.poll() is not None:
                seconds[name] = round(time.monotonic() - started, 1)
        time.sleep(0.2)
    logs = {name: log_path.read_text() for name, (_, log_path) in running.items()}
    failed = [
        f"{name} exited {proc.returncode}; see {log_path}: {logs[name][-900:]}"
        for name, (proc, log_path) in running.items()
        if proc.returncode != 0
    ]
    if failed:
        raise RuntimeError("\n".join(failed))
    return {name: (logs[name], seconds[name]) for name in running}


def _free_port() -> int:
    from del_megatron.ports import free_port

    return free_port()


# ---- one stage, in this process -----------------------------------------------------------------

STAGE_FUNCTIONS: Dict[str, Callable[[Context], None]] = {
    "environment": stage_environment,
    "integration": stage_integration,
    "correctness": stage_correctness,
    "logits_free": stage_logits_free,
    "speed": stage_speed_and_memory,  # writes the memory rows too
    "syncs": stage_syncs,
    "recompiles": stage_recompiles,
    "cuda_graph": stage_cuda_graph,
}


def run_stage(name: str, cpu: bool, out: Path, deadline: Optional[float] = None) -> int:
    """Run one stage here, its rows appended to OUT/gpu_check.jsonl; a stage that raises
    writes one row with ok false and its error. A few seconds before `deadline` (time.time(),
    when the driver kills this process) every thread's Python stack goes to stderr, from a
    watchdog thread that runs even while the stage waits in C (a CUDA sync, NCCL, a compile)."""
    if deadline is not None:
        faulthandler.dump_traceback_later(max(deadline - time.time() - DUMP_BEFORE_S, 0.5))
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    results = Results(out / "gpu_check.jsonl", fresh=False)
    ctx = Context(device, CPU_SIZES if cpu else GPU_SIZES, results, out)
    try:
        if name not in ("environment", "integration"):
            _init_megatron(ctx)
        STAGE_FUNCTIONS[name](ctx)
    except Exception as exc:  # noqa: BLE001  (a stage's failure is a result)
        ctx.results.add(
            name,
            "stage",
            False,
            error=f"{type(exc).__name__}: {exc}"[:1000],
            traceback=traceback.format_exc()[-3000:],
        )
    return 0


# ---- the driver: each stage in a process of its own, killed at its limit ------------------------

DUMP_BEFORE_S = 3  # a stage's stacks are written this long before its kill
# The whole run's seconds, gpu_check.sh's default GPU_CHECK_LIMIT_S: on a GPU 10 minutes of
# device time less 30 s; on the CPU (toy sizes, a CI machine that may be busy) more.
ENVELOPE_S = {"gpu": 570, "cpu": 900}
RESERVE_S = 20  # the driver's start, the kills and the summary
# Seconds each stage's process may take (its start and imports included), in the order they
# run. The integration stage comes right after the environment: the stage most likely to wait
# on something (NCCL, torchrun, two Megatron-LM start-ups) is the one the earlier layout left
# at the end, with what the others had left. Each set fits its envelope less RESERVE_S.
LIMITS_S = {
    "gpu": {
        "environment": 30, "integration": 250, "correctness": 75, "logits_free": 40,
        "speed": 80, "syncs": 25, "recompiles": 30, "cuda_graph": 20,
    },
    "cpu": {
        "environment": 45, "integration": 420, "correctness": 90, "logits_free": 60,
        "speed": 90, "syncs": 60, "recompiles": 60, "cuda_graph": 45,
    },
}  # fmt: skip
STAGE_TAG = "GPU_CHECK_STAGE_TAG"  # in every process of a stage, torchrun's workers included


def stage_limits(cpu: bool, stages: Sequence[str], envelope_s: float) -> Dict[str, float]:
    """{stage: seconds} for the stages asked, in running order; scaled down together when they
    would not fit envelope_s - RESERVE_S."""
    limits = {s: t for s, t in LIMITS_S["cpu" if cpu else "gpu"].items() if s in stages}
    scale = min(1.0, max(envelope_s - RESERVE_S, 0) / max(sum(limits.values()), 1))
    return {s: math.floor(t * scale * 10) / 10 for s, t in limits.items()}


def _tagged_processes(tag: str) -> List[int]:
    """Processes whose environment holds STAGE_TAG=tag (Linux /proc; [] elsewhere)."""
    needle = f"{STAGE_TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_stage(proc: subprocess.Popen, tag: str) -> int:
    """SIGKILL the stage's process group (its session), then every process that carries its
    tag: torchrun starts each worker in a session of its own, and a killed agent's workers are
    orphans. Waits for the stage's process. Returns how many tagged processes were found outside
    the stage's process group (strays)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a process in the kernel's D state
        proc.wait(timeout=30)
    strays = set()
    for _ in range(50):
        left = _tagged_processes(tag)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) != proc.pid:
                    strays.add(pid)
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return len(strays)


@dataclass
class StageRun:
    """How one stage's process ended: "done" (exited by itself), "killed" (at its limit) or
    "interrupted" (gpu_check itself was stopped)."""

    outcome: str
    returncode: Optional[int]
    seconds: float
    strays: int
    stderr_tail: str = ""


def run_stage_process(
    command: Sequence[str], limit_s: float, env: Dict[str, str], stderr: Path
) -> StageRun:
    """Run `command` in a session of its own with a fresh STAGE_TAG, its stderr in a file; at
    limit_s, or when this process is interrupted (SIGINT, or SIGTERM through _interrupt), kill
    it with everything it started. Processes it leaves behind after a normal exit are killed
    too (strays)."""
    tag = uuid.uuid4().hex
    started = time.monotonic()
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            list(command), env={**env, STAGE_TAG: tag}, stderr=err, start_new_session=True
        )
    try:
        proc.wait(timeout=limit_s)
        outcome = "done"
    except subprocess.TimeoutExpired:
        outcome = "killed"
    except KeyboardInterrupt:
        outcome = "interrupted"
    strays = kill_stage(proc, tag)
    returncode = proc.returncode if outcome == "done" else None
    tail = stderr.read_bytes()[-STDERR_TAIL:].decode(errors="replace")
    return StageRun(outcome, returncode, round(time.monotonic() - started, 1), strays, tail)


STDERR_TAIL = 3000  # characters of a failed stage's stderr in its row


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def drive(
    results: Results,
    limits: Dict[str, float],
    envelope_s: float,
    command_of: Callable[[str, float], List[str]],
) -> None:
    """Run each stage's command (command_of(stage, its deadline as time.time())) with its
    limit, in order, its stderr in OUT/gpu_check_<stage>.stderr, and write how it ended: a
    "stage time" row (seconds, limit, outcome), and a failed "stage" row (with the tail of its
    stderr) for a stage killed at its limit, ended by a signal or a non-zero status, or stopped
    because gpu_check itself was (the stages after it do not run)."""
    results.add(
        "environment",
        "stage limits",
        None,
        limits_s=limits,
        sum_s=round(sum(limits.values()), 1),
        envelope_s=envelope_s,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for stage, limit in limits.items():
            command = command_of(stage, time.time() + limit)
            stderr = results.path.with_name(f"gpu_check_{stage}.stderr")
            ended = run_stage_process(command, limit, dict(os.environ), stderr)
            _report_stage(results, stage, limit, ended)
            if ended.outcome == "interrupted":
                print("gpu_check: interrupted; the stages above are what ran", file=sys.stderr)
                break
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_stage(results: Results, stage: str, limit: float, ended: StageRun) -> None:
    error = None
    if ended.outcome == "killed":
        error = f"killed at its limit of {limit:g} s, with every process it started"
    elif ended.outcome == "interrupted":
        error = "stopped: gpu_check was interrupted"
    elif ended.returncode:
        how = f"signal {-ended.returncode}" if ended.returncode < 0 else f"{ended.returncode}"
        error = f"its process ended with status {how}"
    if error:
        results.add(
            stage,
            "stage",
            False,
            error=error,
            limit_s=limit,
            outcome=ended.outcome,
            stderr_tail=ended.stderr_tail,
        )
    strays = {"strays_killed": ended.strays} if ended.strays else {}
    results.add(
        stage,
        "stage time",
        None,
        seconds=ended.seconds,
        limit_s=limit,
        outcome=ended.outcome,
        **strays,
    )


# ---- summary ----------------------------------------------------------------------------------

SUMMARY_FIELDS = (
    "kernel", "value_error", "grad_error", "grad_hidden_error", "grad_weight_error",
    "forward_ms", "backward_ms", "gb_s", "hbm_share", "time_vs_megatron_ce", "time_vs_te_ce",
    "peak_mib", "peak_vs_megatron_ce", "peak_vs_te_ce", "vs_floor", "cuda_reported", "causes",
    "new_graphs_per_call", "replay_error", "data_parallel", "digit_share", "main_grad_rel_error",
    "lm_loss_rel_error", "del_term_rel_error", "run_seconds", "skipped", "error",
)  # fmt: skip
DRIVER_CHECKS = ("stage time", "stage limits")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict) and value:
        return json.dumps(value)[:60]
    return str(value)[:80]


def _stage_table(rows: List[dict]) -> List[str]:
    """Each stage's limit, time and how it ended, and the limits against the envelope."""
    plan = next((r for r in rows if r["check"] == "stage limits"), None)
    if plan is None:
        return []
    times = {r["stage"]: r for r in rows if r["check"] == "stage time"}
    lines = ["", "| stage | limit s | took s | ended |", "|---|---|---|---|"]
    for stage, limit in plan["limits_s"].items():
        took = times.get(stage, {})
        seconds, ended = took.get("seconds", ""), took.get("outcome", "not run")
        lines.append(f"| {stage} | {limit:g} | {seconds} | {ended} |")
    lines.append(
        f"stage limits add up to {plan['sum_s']:g} s of the {plan['envelope_s']:g} s envelope"
    )
    return lines


def summary(rows: List[dict]) -> str:
    """A Markdown table, one line per result, the stages' limits and times, and the verdict:
    passed, failed and the stages with no result."""
    lines = ["| stage | check | ok | figures |", "|---|---|---|---|"]
    for row in rows:
        if row["check"] in DRIVER_CHECKS:
            continue
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
    plan = next((r["limits_s"] for r in rows if r["check"] == "stage limits"), STAGES)
    expected = [s for s in STAGES if s in plan or (s == "memory" and "speed" in plan)]
    missing = [
        s
        for s in expected
        if not any(r["stage"] == s and r["check"] != "stage limits" for r in rows)
    ]
    verdict = f"{len(passed)} passed, {len(failed)} failed"
    killed = [
        r["stage"] for r in rows if r["check"] == "stage time" and r.get("outcome") == "killed"
    ]
    if killed:
        verdict += f"; killed at their limit: {', '.join(killed)}"
    if missing:
        verdict += f"; no result from: {', '.join(missing)}"
    return "\n".join(lines + _stage_table(rows) + ["", verdict])


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
    parser.add_argument("--envelope-s", type=float, help="the whole run's seconds")
    parser.add_argument("--no-summary", action="store_true", help="(gpu_check.sh prints it)")
    parser.add_argument("--stage", choices=list(STAGE_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.summary:
        rows = read_rows(args.summary)
        print(summary(rows))
        return 1 if any(r["ok"] is False for r in rows) or not rows else 0
    if args.stage:
        return run_stage(args.stage, args.cpu, args.out, args.deadline)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --cpu for the toy-size run)", file=sys.stderr)
        return 2
    asked = {"speed" if s == "memory" else s for s in args.stages} | {"environment"}
    envelope_s = args.envelope_s or ENVELOPE_S["cpu" if args.cpu else "gpu"]
    limits = stage_limits(args.cpu, sorted(asked), envelope_s)
    results = Results(args.out / "gpu_check.jsonl")
    base = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out)]
    base += ["--cpu"] if args.cpu else []
    drive(
        results,
        limits,
        envelope_s,
        lambda stage, deadline: [*base, "--stage", stage, "--deadline", str(deadline)],
    )
    rows = read_rows(results.path)
    if not args.no_summary:
        print(summary(rows))
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    skip_final_collections()
    sys.exit(main())
