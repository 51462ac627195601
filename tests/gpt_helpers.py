"""A tiny real Megatron-Core GPTModel on CPU, and number-rich token batches for it."""

from __future__ import annotations

import torch

import del_megatron as dm
from del_megatron import cpu

VOCAB_SIZE = 128  # divisible by TP 1, 2, 4
SEQ = 24
# ids 40..49 are the digits '0'..'9', 50 is '.', 51 is a space
GPT_VOCAB = dm.DigitVocab(digit_ids=range(40, 50), decimal_point_ids=[50])
SPACE = 51


def build_gpt(
    tp: int, sequence_parallel: bool = False, mtp_layers=None, config_kwargs=None, **model_kwargs
):
    """GPTModel with the local (non-TE) spec, identical weights at every TP size."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu.install()
    config_kwargs = {"num_layers": 2, **(config_kwargs or {})}
    config = TransformerConfig(
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=mtp_layers,
        pipeline_dtype=torch.float32,
        **config_kwargs,
    )
    cpu.seed(1234)
    spec = get_gpt_layer_local_spec()
    mtp_spec = None
    if mtp_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=64,
        mtp_block_spec=mtp_spec,
        **{"position_embedding_type": "rope", **model_kwargs},
    )


def number_batch(batch: int, seed: int):
    """(tokens, labels, position_ids) [batch, SEQ]: text of sums like '12.5 + 7 = 19.5'."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < SEQ + 1:
            a = torch.randint(0, 1000, (), generator=gen).item()
            b = torch.randint(0, 100, (), generator=gen).item()
            text = f"{a / 10} + {b} = {a / 10 + b:.1f} "
            for ch in text:
                if ch.isdigit():
                    row.append(40 + int(ch))
                elif ch == ".":
                    row.append(50)
                elif ch == " ":
                    row.append(SPACE)
                else:
                    row.append(60 + ord(ch) % 20)
        rows.append(row[: SEQ + 1])
    seq = torch.tensor(rows)
    positions = torch.arange(SEQ).expand(batch, SEQ)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), positions


def batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """Megatron-Core's get_batch_on_this_cp_rank over `cp_group` (cores 0.18+ take
    is_hybrid_cp first; 0.16 takes the group second)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)
