"""No host sync in the per-micro-batch loss path.

Two nets, so that nothing slips through a CPU run:
- FakeTensorMode (no values exist, so any .item(), bool(), .tolist() raises) for the paths that
  need no collective: numerical_lm_loss and numerical_linear_loss forward + backward, every
  kernel, loss, reduction, dtype and packing;
- benchmarks/host_syncs.HostSyncs (a TorchDispatchMode and patched Tensor methods that record
  value reads, tensors made from Python data, copies across devices and data-dependent shapes)
  around the same calls, and, on gloo workers, around TP > 1, CP and THD steps and a real
  Megatron schedule step through the hook (host_sync_workers.py).

A first call before the counted one may make what is made once per run (index tensors on the
device, the shard-size check, the fp32-output GEMM probe); the counted call may not. The one
host sync a step allowed is the "digit" reduction's: its step-wide counts copied to an NCCL
group's device when the batches are on the host (none on these gloo ranks).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import del_megatron as dm
from benchmarks.host_syncs import HostSyncs
from del_megatron.loss import LOSSES, REDUCTIONS

from . import host_sync_workers as workers
from .cases import (
    IGNORE,
    PADDED_VOCAB_SIZE,
    SPLIT_VOCAB,
    TOKEN_FORM,
    number_rich_labels,
    token_share,
)

# THD: one packed row of three documents.
CU_SEQLENS = torch.tensor([0, 17, 30, 48], dtype=torch.int32)


def fake_layouts(kernel: str, packing: str):
    """(dtype, loss, reduction, inplace) of every numerical_lm_loss call a fake-tensor test
    makes for `kernel` and `packing`: bf16 logits for every loss and reduction, fp32 for DEL
    with and without inplace (not "compiled", whose inplace chunks are the same eager passes)."""
    layouts = [
        (torch.bfloat16, loss, reduction, False)
        for loss, reduction in itertools.product(LOSSES, REDUCTIONS)
    ]
    for reduction, inplace in itertools.product(REDUCTIONS, (False, True)):
        if not inplace or (kernel != "compiled" and packing == "bshd"):
            layouts.append((torch.float32, "del", reduction, inplace))
    return layouts


def _inputs(packing: str, dtype: torch.dtype, seed: int):
    """Real (labels [b, s], logits [s, b, V], cu_seqlens or None)."""
    if packing == "thd":
        labels = number_rich_labels(1, 48, seed)
        cu_seqlens = CU_SEQLENS
    else:
        labels, cu_seqlens = number_rich_labels(2, 24, seed), None
    s, b = labels.size(1), labels.size(0)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, b, PADDED_VOCAB_SIZE, generator=gen).to(dtype)
    return labels, logits, cu_seqlens


def _fake(mode: FakeTensorMode, *tensors):
    return [None if t is None else mode.from_tensor(t) for t in tensors]


@pytest.mark.parametrize("packing", ["bshd", "thd"])
@pytest.mark.parametrize("kernel", ["softmax", "recompute", "compiled"])
def test_numerical_lm_loss_on_fake_tensors(kernel, packing):
    """Forward + backward of every layout in fake_layouts on fake tensors: nothing reads a
    value (that would raise) and nothing is made from host data or copied across devices."""
    mode = FakeTensorMode()
    for dtype, loss, reduction, inplace in fake_layouts(kernel, packing):
        labels, logits, cu_seqlens = _fake(mode, *_inputs(packing, dtype, seed=len(loss)))
        cfg = dm.NumericalLossConfig(
            loss=loss,
            alpha=0.5,
            vocab=SPLIT_VOCAB,
            reduction=reduction,
            digit_share=token_share(reduction),
            ignore_index=IGNORE,
        )
        how = dict(
            kernel=kernel, inplace=inplace, layout=dm.VocabParallelLayout(cu_seqlens=cu_seqlens)
        )
        with mode, HostSyncs() as syncs:
            leaf = logits.clone().requires_grad_(True)
            # inplace needs a non-leaf (autograd refuses to overwrite a leaf's saved value)
            x = leaf * 1 if inplace else leaf
            out = dm.numerical_lm_loss(labels, x, cfg, **how)
            (out * 0.5).sum().backward()
        assert leaf.grad is not None and leaf.grad.shape == logits.shape
        what = f"{kernel} {packing} {dtype} {loss} {reduction} inplace={inplace}"
        assert not syncs.events, f"{what}:\n{syncs.report()}"


LINEAR_CASES = [
    pytest.param(route, masked, id=f"{route}-{'loss_mask' if masked else 'no_mask'}")
    for route, masked in itertools.product(("backward", "forward"), (False, True))
]


@pytest.mark.parametrize("route, masked", LINEAR_CASES)
def test_numerical_linear_loss_on_fake_tensors(route, masked):
    """The logits-free path on fake tensors, both weight-gradient routes, with and without the
    loss mask that --del-logits-free passes, THD packing: bf16 for every loss, fp32 for DEL."""
    mode = FakeTensorMode()
    layouts = [(torch.bfloat16, loss) for loss in LOSSES] + [(torch.float32, "del")]
    for dtype, loss in layouts:
        labels = number_rich_labels(1, 48, seed=3)
        gen = torch.Generator().manual_seed(3)
        hidden = torch.randn(48, 1, 16, generator=gen).to(dtype)
        weight = torch.randn(PADDED_VOCAB_SIZE, 16, generator=gen).to(dtype)
        mask = torch.rand(1, 48, generator=gen).round()
        labels, hidden, weight, mask, cu = _fake(mode, labels, hidden, weight, mask, CU_SEQLENS)
        cfg = dm.NumericalLossConfig(
            loss=loss, alpha=0.5, vocab=SPLIT_VOCAB, ignore_index=IGNORE, **TOKEN_FORM
        )
        with mode, HostSyncs() as syncs:
            h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
            out = dm.numerical_linear_loss(
                h,
                w,
                labels,
                cfg,
                dm.VocabParallelLayout(cu_seqlens=cu),
                loss_mask=mask if masked else None,
                weight_gradient=route,
                chunk_tokens=20,
            )
            (out * mask).sum().backward()
        assert h.grad is not None and w.grad is not None
        assert not syncs.events, f"{route} {dtype} {loss}:\n{syncs.report()}"


def test_host_syncs_catches_what_it_should():
    """The net has teeth: each kind of sync the loss path once had is recorded where it is."""
    x = torch.arange(12.0).view(3, 4)
    with HostSyncs() as syncs:
        x[:, [1, 2]]  # a Python list as an index
        bool(x.any())
        x.sum().item()
        x.tolist()
        x.cpu()
        torch.tensor([1, 2])
        x[x > 3]  # a boolean mask
        torch.nn.functional.one_hot(torch.tensor([1, 2]), 4)  # checks its classes on the host
        x.to("meta")
    kinds = syncs.counts()
    assert kinds == {"host data": 3, "item": 5, "device copy": 2, "data-dependent shape": 1}, (
        syncs.report()
    )
    assert all(e.where.startswith("tests/test_host_syncs.py:") for e in syncs.events), (
        syncs.report()
    )


# ---- gloo workers: tensor and context parallelism, packing, the hook ------------------------


LOSS_CASES = [pytest.param(check, id=check.removeprefix("check_")) for check in workers.LOSS_CHECKS]


@pytest.mark.parametrize("check", LOSS_CASES)
def test_parallel_loss_steps(gloo, check):
    """TP 2 x CP 2 (4 ranks): numerical_lm_loss and numerical_linear_loss steps, counted."""
    gloo(4, tensor_model_parallel_size=2, context_parallel_size=2).run(getattr(workers, check), 11)


# The hook checks: (reduction, logits_free) of each counted training step.
HOOK_STEPS = [("token", False), ("digit", False), ("token", True)]
_hook_results: dict = {}


def _hook_result(gloo, tmp_path_factory, reduction: str, logits_free: bool) -> dict:
    """What workers.check_hook_step found (rank 0), one worker run per step kind."""
    key = (reduction, logits_free)
    if key not in _hook_results:
        out = tmp_path_factory.mktemp("hook") / "syncs.json"
        gloo(2).run(workers.check_hook_step, reduction, logits_free, str(out))
        _hook_results[key] = json.loads(out.read_text())
    return _hook_results[key]


def _hook_id(reduction: str, logits_free: bool) -> str:
    return f"{reduction}-{'logits_free' if logits_free else 'materialised'}"


@pytest.mark.parametrize(
    "reduction, logits_free", [pytest.param(*k, id=_hook_id(*k)) for k in HOOK_STEPS]
)
def test_hook_step_loss_path(gloo, tmp_path_factory, reduction, logits_free):
    """Megatron's schedule (2 micro-batches, TP 2) through register()'s hook (materialised or
    logits-free), its loss_func wrapper and, for "digit", the step accounting: del_megatron's
    loss path (everything but workers.OTHERS_FILES) makes no host sync in the counted step. On a
    core without logits-free support, its refusal is checked instead."""
    result = _hook_result(gloo, tmp_path_factory, reduction, logits_free)
    assert not result["loss_path"], "\n".join(result["loss_path"])


@pytest.mark.parametrize(
    "reduction, logits_free", [pytest.param(*k, id=_hook_id(*k)) for k in HOOK_STEPS]
)
def test_hook_step_glue(gloo, tmp_path_factory, reduction, logits_free):
    """The same step: the Megatron glue and the logits-free kernel (workers.OTHERS_FILES)
    sync at most once a step for "digit" (the step-wide digit count), never for "token"."""
    result = _hook_result(gloo, tmp_path_factory, reduction, logits_free)
    allowed = 1 if reduction == "digit" else 0
    assert len(result["others"]) <= allowed, "\n".join(result["others"])


@pytest.mark.parametrize("kernel", ["softmax", "recompute", "compiled", "linear"])
def test_chunking_vocab_on_fake_tensors(kernel):
    """A chunking vocab's slot logits (1,110 number tokens): forward + backward of DEL (both
    reductions, both slot rules) and DIST2 (the other heads take the same slot logits), bf16,
    materialised and logits-free (loss mask given), on fake tensors, with no sync."""
    from .chunked_workers import VOCAB, VOCAB_SIZE, labels_for

    mode = FakeTensorMode()
    cases = [("del", "token", "any"), ("del", "digit", "any"), ("dist2", "token", "any")]
    cases += [("del", "digit", "length"), ("dist2", "token", "length")]
    for loss, reduction, rule in cases:
        gen = torch.Generator().manual_seed(1)
        labels = labels_for(2, 12, seed=1)
        logits = torch.randn(12, 2, VOCAB_SIZE, generator=gen).to(torch.bfloat16)
        hidden = torch.randn(12, 2, 8, generator=gen).to(torch.bfloat16)
        weight = torch.randn(VOCAB_SIZE, 8, generator=gen).to(torch.bfloat16)
        mask = (labels != IGNORE).float()
        labels, logits, hidden, weight, mask = _fake(mode, labels, logits, hidden, weight, mask)
        cfg = dm.NumericalLossConfig(
            loss=loss,
            alpha=0.5,
            vocab=VOCAB,
            reduction=reduction,
            digit_share=token_share(reduction),
            ignore_index=IGNORE,
            slot_logits=rule,
        )
        with mode, HostSyncs() as syncs:
            if kernel == "linear":
                leaves = (hidden.requires_grad_(True), weight.requires_grad_(True))
                out = dm.numerical_linear_loss(*leaves, labels, cfg, loss_mask=mask)
            else:
                leaves = (logits.requires_grad_(True),)
                out = dm.numerical_lm_loss(labels, logits, cfg, kernel=kernel)
            (out * mask).sum().backward()
        assert all(leaf.grad is not None for leaf in leaves)
        assert not syncs.events, f"{kernel} {loss} {reduction} {rule}:\n{syncs.report()}"


def test_index_tensors_hold_their_values_and_copy_nothing_from_the_host():
    """device.int_tensor fills runs (equal or consecutive values) and single values on the
    device: the values come out as given, and no host-to-device copy or sync is recorded."""
    from del_megatron.device import int_tensor

    gen = torch.Generator().manual_seed(3)
    scattered = torch.randint(-2, 300, (200,), generator=gen).tolist()
    values = tuple([*range(40, 70), -2, -2, -2, 5, *scattered, 7, 7, 8, 9, 9])
    assert int_tensor(values)(torch.device("cpu")).tolist() == list(values)
    assert int_tensor(())(torch.device("cpu")).shape == (0,)
    with FakeTensorMode(), HostSyncs() as syncs:
        int_tensor(values)(torch.device("cpu"))
    assert not syncs.events, syncs.report()


def test_index_tensors_are_made_once_per_device_and_once_per_fake_mode():
    """device.on_device keeps what it made: one real tensor per (key, device) for the process,
    and inside a FakeTensorMode one fake tensor per mode (a chunked kernel asks once a chunk),
    never a fake tensor outside its mode nor a real one inside it."""
    from torch._subclasses.fake_tensor import FakeTensor

    from del_megatron.device import int_tensor, on_device

    made = []

    def make(device):
        made.append(device)
        return int_tensor((4, 5, 6, 1))(device)

    key = ("test_index_tensors_are_made_once", id(made))
    cpu = torch.device("cpu")
    real = on_device(key, cpu, make)
    assert on_device(key, cpu, make) is real and len(made) == 1
    first, second = FakeTensorMode(), FakeTensorMode()
    with first:
        fake = on_device(key, cpu, make)
        assert isinstance(fake, FakeTensor) and on_device(key, cpu, make) is fake
    with second:
        other = on_device(key, cpu, make)
        assert isinstance(other, FakeTensor) and other is not fake
    assert len(made) == 3
    assert on_device(key, cpu, make) is real and real.tolist() == [4, 5, 6, 1]
