"""Probe: Mamba layers on CPU under Triton's interpreter (TRITON_INTERPRET=1).

Checks, in fp32 on tiny shapes:

- ``ssd``: mamba_ssm's Triton SSD scan (``mamba_chunk_scan_combined``) against its pure-torch
  reference (``ssd_chunk_scan_combined_ref``): output and the gradients of all eight inputs.
- ``layer``: one Megatron-Core ``MambaLayer`` (local spec: WrappedTorchNorm + MambaMixer with
  ColumnParallelLinear/RowParallelLinear, ``use_mamba_mem_eff_path=False``), forward and
  backward: every parameter gets a finite gradient; prints the time of each half on a second
  call, and of the first call (lazy imports and set-up included).
- ``mixer``: a ``MambaMixer`` on the memory-efficient path (``use_mamba_mem_eff_path=True``,
  Megatron's default, ``mamba_split_conv1d_scan_combined``) with a pure-torch stand-in for
  causal_conv1d, against the same module with the path switched off (torch ``nn.Conv1d`` +
  ``mamba_chunk_scan_combined``): output, input gradient and parameter gradients.

It is not part of the tests: Mamba layers run on a GPU, and getting them onto a CPU needs patches
to private parts of torch and Triton (``torch.cuda.device`` made a no-op context,
``torch.cuda.get_device_properties`` faked, ``torch.cuda.current_device`` returning "cpu",
Triton's ``Autotuner.prune_configs`` cut to one config so nothing is benchmarked), a stub module
for mamba_ssm's Mamba-1 CUDA extension ``selective_scan_cuda``, and, for ``mixer``, the
causal_conv1d stand-in injected into ``mamba_ssm.ops.triton.ssd_combined``.

Install (a separate venv; torch, triton 3.8.0 and megatron-core come from the repo's .venv312):

    python3.12 -m venv /tmp/mamba-venv
    echo "$PWD/.venv312/lib/python3.12/site-packages" \\
        > /tmp/mamba-venv/lib/python3.12/site-packages/main312.pth
    MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \\
    MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \\
        /tmp/mamba-venv/bin/pip install --no-build-isolation --no-deps \\
        mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
    /tmp/mamba-venv/bin/pip install einops==0.8.2

Run (optionally naming parts):

    TRITON_INTERPRET=1 /tmp/mamba-venv/bin/python benchmarks/mamba_cpu_probe.py [ssd layer mixer]

Prints a version line, then one line per part: ``<part> OK|FAIL`` with its max abs differences
(and the input or parameter they come from), times in seconds and gradient counts. Exits 1 if
any difference exceeds 1e-4, any gradient is missing or not finite, or a part raises.
"""

import argparse
import contextlib
import logging
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import version

import torch
import torch.nn.functional as F

TOL = 1e-4
# batch, length, heads, head dim, groups, state dim, chunk size
B, L, H, P, G, N, CS = 1, 16, 2, 8, 1, 16, 8
HIDDEN = 16


def patch_cpu() -> None:
    """Patch torch/Triton private parts and stub `selective_scan_cuda` so mamba_ssm runs on CPU."""
    # mamba_ssm/__init__ imports selective_scan_interface, which imports the Mamba-1 CUDA ext.
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    if not torch.cuda.is_available():
        # Kernel launches run under `torch.cuda.device(t.device.index)`, which raises for CPU
        # tensors; backward grids are sized from the SM count; Megatron places parameters on
        # torch.cuda.current_device().
        torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
            multi_processor_count=4
        )
        torch.cuda.current_device = lambda: "cpu"
    # The Autotuner would benchmark every config through an active GPU driver; keep the first.
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]


def patch_causal_conv1d() -> None:
    """Inject pure-torch causal_conv1d fwd/bwd (no seq_idx/initial states) into ssd_combined."""
    from mamba_ssm.ops.triton import ssd_combined

    def conv(x, weight, bias, silu):  # x (b, d, l), weight (d, w)
        width = weight.shape[-1]
        y = F.conv1d(F.pad(x, (width - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[1])
        return F.silu(y) if silu else y

    def fwd(x, weight, bias, seq_idx, initial_states, final_states_out, silu):
        assert seq_idx is None and initial_states is None
        return conv(x, weight, bias, silu)

    def bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, ret_dinit, silu):
        assert seq_idx is None and initial_states is None
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        bias = bias.detach().requires_grad_() if bias is not None else None
        leaves = [t for t in (x, weight, bias) if t is not None]
        with torch.enable_grad():
            grads = torch.autograd.grad(conv(x, weight, bias, silu), leaves, dout)
        gx = dx.copy_(grads[0]) if dx is not None else grads[0]
        return gx, grads[1], grads[2] if bias is not None else None, None

    ssd_combined.causal_conv1d_fwd_function = fwd
    ssd_combined.causal_conv1d_bwd_function = bwd


def max_diffs(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[str, float]:
    """Return the name and value of the largest max abs difference over named tensor pairs."""
    diffs = {k: (a - b).abs().max().item() for k, (a, b) in pairs.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return worst, diffs[worst]


def part_ssd() -> bool:
    """Triton SSD scan against mamba_ssm's reference: output and all input gradients."""
    from mamba_ssm.ops.triton.ssd_combined import (
        mamba_chunk_scan_combined,
        ssd_chunk_scan_combined_ref,
    )

    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias"]
    inputs = [
        torch.randn(B, L, H, P),
        torch.randn(B, L, H) * 0.5,
        -torch.rand(H) - 0.5,
        torch.randn(B, L, G, N),
        torch.randn(B, L, G, N),
        torch.randn(H),
        torch.randn(B, L, H, P),
        torch.randn(H) * 0.1,
    ]
    grad_out = torch.randn(B, L, H, P)
    outs, grads, times = [], [], []
    for fn in (mamba_chunk_scan_combined, ssd_chunk_scan_combined_ref):
        x, dt, A, Bm, C, D, z, dt_bias = args = [t.clone().requires_grad_() for t in inputs]
        t0 = time.perf_counter()
        y = fn(x, dt, A, Bm, C, CS, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        t1 = time.perf_counter()
        y.backward(grad_out)
        times.append((t1 - t0, time.perf_counter() - t1))
        outs.append(y)
        grads.append([a.grad for a in args])
    out_diff = (outs[0] - outs[1]).abs().max().item()
    worst, grad_diff = max_diffs({n: (a, b) for n, a, b in zip(names, *grads, strict=True)})
    ok = out_diff <= TOL and grad_diff <= TOL
    (fwd_s, bwd_s), _ = times
    print(
        f"ssd {'OK' if ok else 'FAIL'}: mamba_chunk_scan_combined vs ssd_chunk_scan_combined_ref: "
        f"max|diff| out {out_diff:.2e}, grads {grad_diff:.2e} (d{worst}); "
        f"kernel fwd {fwd_s:.2f}s bwd {bwd_s:.2f}s"
    )
    return ok


def init_megatron() -> None:
    """Single-process gloo group, model parallel 1x1, and an RNG tracker that needs no CUDA."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    # model_parallel_cuda_manual_seed needs CUDA; the inference tracker's fork() is a no-op.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build(spec_name: str, mem_eff: bool) -> torch.nn.Module:
    """Build a tiny MambaMixer (`spec_name="mixer"`) or MambaLayer (`"layer"`) on CPU."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=H,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        mamba_state_dim=N,
        mamba_head_dim=P,
        mamba_num_groups=G,
        mamba_num_heads=H,
        use_mamba_mem_eff_path=mem_eff,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    if spec_name == "mixer":
        return build_module(mixer, config, d_model=HIDDEN, layer_number=1, pg_collection=pgs)
    layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm, mixer=mixer, mamba_bda=get_bias_dropout_add
        ),
    )
    return build_module(layer, config, layer_number=1, pg_collection=pgs)


def fwd_bwd(
    module: torch.nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Run forward and backward of mean(out**2); return output, input grad and both times."""
    hidden = hidden.clone().requires_grad_()
    t0 = time.perf_counter()
    out = module(hidden)
    out = out[0] if isinstance(out, tuple) else out
    t1 = time.perf_counter()
    out.pow(2).mean().backward()
    return out, hidden.grad, t1 - t0, time.perf_counter() - t1


def grads_ok(module: torch.nn.Module) -> tuple[int, int, bool]:
    """Count parameters with a gradient; say whether every parameter has a finite one."""
    grads = [p.grad for p in module.parameters()]
    have = [g for g in grads if g is not None]
    finite = all(torch.isfinite(g).all().item() for g in have)
    return len(have), len(grads), finite and len(have) == len(grads)


def part_layer() -> bool:
    """MambaLayer (local spec, mem-eff path off): forward and backward, finite gradients."""
    init_megatron()
    layer = build("layer", mem_eff=False)
    hidden = torch.randn(L, B, HIDDEN)
    _, _, first_fwd_s, first_bwd_s = fwd_bwd(layer, hidden)
    layer.zero_grad()
    out, _, fwd_s, bwd_s = fwd_bwd(layer, hidden)
    have, total, ok = grads_ok(layer)
    ok = ok and out.shape == (L, B, HIDDEN) and bool(torch.isfinite(out).all())
    print(
        f"layer {'OK' if ok else 'FAIL'}: MambaLayer(local spec, mem_eff=False) out "
        f"{tuple(out.shape)}: fwd {fwd_s:.2f}s bwd {bwd_s:.2f}s (first call "
        f"{first_fwd_s + first_bwd_s:.2f}s in all); finite grads {have}/{total} params"
    )
    return ok


def part_mixer() -> bool:
    """MambaMixer mem-eff path (torch conv stand-in) against the same module with it off."""
    patch_causal_conv1d()
    init_megatron()
    mixer = build("mixer", mem_eff=True)
    hidden = torch.randn(L, B, HIDDEN)
    out, dhidden, fwd_s, bwd_s = fwd_bwd(mixer, hidden)
    have, total, ok = grads_ok(mixer)
    grads = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad()
    mixer.use_mem_eff_path = False
    out_ref, dhidden_ref, _, _ = fwd_bwd(mixer, hidden)
    pairs = {"out": (out, out_ref), "dhidden": (dhidden, dhidden_ref)}
    pairs.update({n: (g, mixer.get_parameter(n).grad) for n, g in grads.items()})
    worst, diff = max_diffs(pairs)
    ok = ok and diff <= TOL
    print(
        f"mixer {'OK' if ok else 'FAIL'}: MambaMixer(mem_eff=True, torch conv stand-in) vs "
        f"mem_eff=False: max|diff| {diff:.2e} ({worst}); fwd {fwd_s:.2f}s bwd {bwd_s:.2f}s; "
        f"finite grads {have}/{total} params"
    )
    return ok


PARTS: dict[str, Callable[[], bool]] = {"ssd": part_ssd, "layer": part_layer, "mixer": part_mixer}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named parts (all by default); return 1 if any fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", choices=list(PARTS), help="default: all")
    parts = parser.parse_args(argv).parts or list(PARTS)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before mamba_ssm's kernels are imported
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    patch_cpu()
    print(
        f"torch {torch.__version__}, triton {version('triton')}, mamba_ssm {version('mamba_ssm')}, "
        f"megatron-core {version('megatron-core')}, "
        f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}"
    )
    ok = True
    for name in parts:
        torch.manual_seed(0)
        try:
            ok = PARTS[name]() and ok
        except Exception as e:
            print(f"{name} FAIL: {type(e).__name__}: {e}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
