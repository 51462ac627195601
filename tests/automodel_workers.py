"""Bodies run on gloo ranks for tests/test_automodel_loss.py: the AutoModel loss on DTensor
logits sharded on the vocabulary, as AutoModel's tensor-parallel plans hand them over."""

from __future__ import annotations

import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron.automodel.loss import NumericalLoss

VOCAB = dm.DigitVocab(range(3, 13), [13])
V = 32


def batch(seed: int, b: int = 2, s: int = 24):
    """Labels [b, s] rich in numbers (ids 3..13 are digits and '.'), some ignored; fp32 logits
    [b, s, V]."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 16, (b, s), generator=g)
    labels[:, :3] = -100
    logits = torch.randn(b, s, V, generator=g, dtype=torch.float64).float()
    return labels, logits


def sharded_equals_whole(loss: str, reduction: str) -> None:
    """TP 2: the loss and the logits' gradient on the local shard of a Shard(-1) DTensor equal
    the whole-vocabulary loss on a plain tensor (the gradient's shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    labels, logits = batch(7)
    share = dict(digit_share=0.3) if reduction == "token" else {}
    fn = NumericalLoss(
        numerical_loss=loss,
        alpha=0.3,
        reduction=reduction,
        digit_ids=range(3, 13),
        decimal_point_ids=[13],
        **share,
    )
    fn.begin_step(fn.count_digit_targets([labels]))
    whole = logits.clone().requires_grad_()
    expected = fn(logits=whole, labels=labels, num_label_tokens=40)
    expected.backward()
    fn.begin_step(fn.count_digit_targets([labels]))
    dt = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
    got = fn(logits=dt, labels=labels, num_label_tokens=40)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    shard = whole.grad.chunk(tp, dim=-1)[rank]
    torch.testing.assert_close(dt.grad.to_local(), shard, rtol=1e-5, atol=1e-7)


def other_placements_are_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    labels, logits = batch(3)
    fn = NumericalLoss(
        digit_ids=range(3, 13), decimal_point_ids=[13], reduction="token", digit_share=0.5
    )
    try:
        fn(logits=distribute_tensor(logits, mesh, [Shard(1)]), labels=labels, num_label_tokens=9)
    except ValueError as err:
        assert "placed (Shard(dim=1),)" in str(err) and "Shard(-1)" in str(err), str(err)
    else:
        raise AssertionError("a sequence-sharded DTensor was accepted")
