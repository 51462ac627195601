"""Loss curves of a few training steps: Adam at TP 1 / 2, and Megatron's own pipeline schedules
(PP 2, virtual stages)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron import cpu
from del_megatron import megatron as dmm

from ..cases import TOKEN_FORM
from ..gpt_helpers import GPT_VOCAB, build_gpt, number_batch
from .config import CFG


def train_curve(tp: int, sp: bool, steps: int, out_path: str, loss: str = "del") -> None:
    """`steps` Adam steps on number batches; rank 0 writes the mean-loss curve as JSON."""
    model = build_gpt(tp, sequence_parallel=sp)
    cfg = dm.NumericalLossConfig(loss=loss, alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM)
    dmm.register(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    curve = []
    try:
        for step in range(steps):
            tokens, labels, positions = number_batch(4, seed=100 + step)
            optimizer.zero_grad()
            per_token = model(tokens, positions, None, labels=labels)
            mean = per_token.mean()
            mean.backward()
            cpu.sync_sequence_parallel_grads(model)
            optimizer.step()
            curve.append(mean.item())
    finally:
        dmm.unregister()
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(curve, fh)


def _stage_models(pp_size: int, vp_size: int, num_layers: int):
    """This pipeline rank's model chunks (one per virtual stage) with the weights of the
    single-stage model (same seed): each layer takes the weights of its global layer_number."""
    from megatron.core import parallel_state

    full = build_gpt(1, config_kwargs={"num_layers": num_layers})
    source = full.state_dict()
    chunks = []
    for vp_stage in range(vp_size):
        extra = {"pipeline_model_parallel_size": pp_size, "num_layers": num_layers}
        kwargs = {}
        if vp_size > 1:
            extra["virtual_pipeline_model_parallel_size"] = vp_size
            # gloo's batch_isend_irecv pairs the interleaved schedule's sends and receives
            # across micro-batches (losses off by 0.1% at step 0); NCCL's does not.
            extra["batch_p2p_comm"] = False
            kwargs["vp_stage"] = vp_stage
        stage = build_gpt(
            1,
            config_kwargs=extra,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            **kwargs,
        )
        target = {}
        for name in stage.state_dict():
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers.") :].split(".", 1)
                number = stage.decoder.layers[int(local)].layer_number
                name_in_full = f"decoder.layers.{number - 1}.{rest}"
            else:
                name_in_full = name
            target[name] = source[name_in_full]
        stage.load_state_dict(target)
        chunks.append(stage)
    return chunks


def pipeline_curve(steps: int, out_path: str, vp_size: int = 1) -> None:
    """Train a 4-layer GPT through Megatron's own schedules (PP = world size, vp_size virtual
    stages a rank: the interleaved schedule); the last stage writes its per-step reports. The
    loss seam must run on the last stage only."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from del_megatron.megatron import registration as reg

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = _stage_models(pp_size, vp_size, num_layers=4)
    dmm.register(CFG)
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=3e-3)
    calls = []

    def forward_step(data_iterator, model):
        tokens, labels, positions = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)
        calls.append(reg.find(output) is not None)
        mask = torch.ones_like(labels, dtype=torch.float)
        return output, partial(dmm.numerical_loss_func, mask)

    reports = []
    try:
        for step in range(steps):
            batches = [number_batch(2, seed=1000 * step + i) for i in range(4)]
            optimizer.zero_grad()
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks] if vp_size > 1 else iter(batches),
                model=chunks,
                num_microbatches=4,
                seq_length=batches[0][0].size(1),
                micro_batch_size=2,
            )
            optimizer.step()
            if reduced:
                summed = {k: sum(r[k] for r in reduced).tolist() for k in reduced[0]}
                reports.append(summed)
    finally:
        dmm.unregister()
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if vp_size == 1:
        assert all(calls) if last else not any(calls), (pp_rank, calls)
    else:  # the last rank's last virtual stage computes the loss, its first one does not
        assert sum(calls) == (steps * 4 if last else 0), (pp_rank, sum(calls), len(calls))
    assert bool(reports) == last
    if last:
        with open(out_path, "w") as fh:
            json.dump(reports, fh)
