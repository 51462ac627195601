"""The Hugging Face side of the continued-pretraining path (tests/test_bridge.py), run in a fresh
process each (python -m tests.hf_workers <step> <folder> <out.json>):

- `make`: a tiny Qwen2-class model made from a config with `transformers`, given a few AdamW
  steps on the training text (so its loss on that text is far below a random model's ln V),
  saved as a Hugging Face checkpoint with an offline digit-splitting tokenizer; and the
  training text as a Megatron indexed dataset. Every document is the same SEQ tokens, so every
  Megatron sample (SEQ + 1 tokens of the concatenated stream) is the same sequence whatever the
  shuffle: the first training batch is known, and its cross-entropy through `transformers` is
  the reference for the first step's `ce loss`.
- `prepare`: `make`, then examples/bridge_convert.py import --cpu of the model.
- `export_and_check`: examples/bridge_convert.py export of Bridge's DEL checkpoint (and of
  Megatron-LM's, --megatron-lm) in one process; each exported model loads in `transformers`,
  its weights are the DEL-trained Megatron checkpoint's (not the original model's), and its
  logits on a batch match the Megatron model's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

import numpy
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 16
VOCAB = 512  # the model's; the tokenizer has 262 tokens
TEXT = "12 x 7 = 84, 3.5 + 4 is 7.5"  # its first SEQ tokens are the training sequence
DOCUMENTS = 400  # 1% (the validation and test splits) is 4 documents


def hf_dir(folder: str) -> str:
    return os.path.join(folder, "hf_model")


def data_prefix(folder: str) -> str:
    return os.path.join(folder, "data", "numbers_text_document")


def tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir(folder))


def text_ids(tok) -> list:
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= SEQ, (len(ids), ids)
    return ids[:SEQ]


def qwen2_tokenizer():
    """A Qwen2 tokenizer (byte-level BPE with Qwen2's pre-tokenizer, which splits numbers one
    digit per token) over the 256 byte symbols and a few merges: offline, and loaded back by
    AutoTokenizer as Qwen2Tokenizer from the model folder, as a Qwen2.5 checkpoint's is."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    merges = [("Ġ", "x"), ("Ġ", "i"), ("Ġi", "s"), ("Ġ", "="), ("Ġ", "+")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None)


def sample(ids: list) -> Dict[str, torch.Tensor]:
    """The Megatron sample every index gives: the stream is `ids` repeated, so tokens are the
    SEQ ids and the labels are the same shifted by one (wrapping to the next copy)."""
    tokens = torch.tensor([ids])
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}


def hf_cross_entropy(model, batch) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits.double()
    return float(torch.nn.functional.cross_entropy(logits[0], batch["labels"][0]))


def make(folder: str, out: str) -> None:
    from transformers import Qwen2ForCausalLM

    from .bridge_workers.fixtures import tiny_hf_config

    torch.manual_seed(0)
    tok = qwen2_tokenizer()
    config = tiny_hf_config()
    config.vocab_size = VOCAB
    model = Qwen2ForCausalLM(config).float()
    batch = sample(text_ids(tok))
    result: Dict[str, Any] = {"random_model_ce": hf_cross_entropy(model, batch)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        logits = model(input_ids=batch["tokens"]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], batch["labels"][0])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(hf_dir(folder))
    tok.save_pretrained(hf_dir(folder))
    result["hf_ce"] = hf_cross_entropy(model, batch)
    result["tokens"] = batch["tokens"][0].tolist()

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(data_prefix(folder)), exist_ok=True)
    builder = IndexedDatasetBuilder(data_prefix(folder) + ".bin", dtype=numpy.int32)
    for _ in range(DOCUMENTS):
        builder.add_document(torch.tensor(batch["tokens"][0].tolist()), [SEQ])
    builder.finalize(data_prefix(folder) + ".idx")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def convert(argv: list) -> None:
    """examples/bridge_convert.py with these arguments, in this process (its main())."""
    import importlib.util

    path = os.path.join(ROOT, "examples", "bridge_convert.py")
    spec = importlib.util.spec_from_file_location("bridge_convert", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(argv) == 0


def prepare(folder: str, out: str) -> None:
    """`make`, then the import: bridge_convert.py import --hf-model ... --cpu."""
    make(folder, out)
    convert(import_args(folder) + ["--cpu"])


def import_args(folder: str) -> list:
    return ["import", "--hf-model", hf_dir(folder), "--megatron-path", megatron_dir(folder)]


def export_args(folder: str) -> list:
    return [
        "export",
        "--hf-model",
        hf_dir(folder),
        "--megatron-path",
        trained_dir(folder),
        "--hf-path",
        exported_dir(folder),
    ]


def megatron_dir(folder: str) -> str:
    return os.path.join(folder, "megatron")


def trained_dir(folder: str) -> str:
    return os.path.join(folder, "del_checkpoints")


def exported_dir(folder: str) -> str:
    return os.path.join(folder, "hf_del")


# Hugging Face name -> Megatron-Core name of the weights that convert one to one (the
# attention's q/k/v are interleaved into linear_qkv, the MLP's gate/up into linear_fc1).
SAME_WEIGHTS = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    **{
        f"model.layers.{i}.{hf}": f"decoder.layers.{i}.{mc}"
        for i in range(2)
        for hf, mc in (
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
            ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
            ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
        )
    },
}


def export_and_check(folder: str, out: str, megatron_lm_checkpoint: str = "") -> None:
    """In one process: bridge_convert.py export ... --cpu of Bridge's DEL checkpoint and, given
    one, export --megatron-lm ... --cpu of the checkpoint Megatron-LM wrote; each checked
    (`check_export`). Results under "bridge" and "megatron_lm"."""
    from del_megatron.cpu.bridge import activate

    activate()  # before Bridge's import (the Transformer Engine placeholder)
    from megatron.bridge import AutoBridge

    convert(export_args(folder) + ["--cpu"])
    bridge = AutoBridge.from_hf_pretrained(hf_dir(folder))
    megatron = bridge.load_megatron_model(trained_dir(folder), wrap_with_ddp=False)[0]
    result = {"bridge": check_export(folder, exported_dir(folder), megatron)}
    if megatron_lm_checkpoint:
        from megatron.bridge.training.model_load_save import load_megatron_model

        target = os.path.join(folder, "hf_del_megatron_lm")
        argv = ["export", "--megatron-lm", "--hf-model", hf_dir(folder)]
        convert(argv + ["--megatron-path", megatron_lm_checkpoint, "--hf-path", target, "--cpu"])
        path = os.path.join(megatron_lm_checkpoint, "iter_{:07d}")
        with open(os.path.join(megatron_lm_checkpoint, "latest_checkpointed_iteration.txt")) as f:
            path = path.format(int(f.read()))
        megatron = load_megatron_model(path, model_type="gpt", use_cpu_init=True)
        megatron = megatron[0] if isinstance(megatron, list) else megatron
        result["megatron_lm"] = check_export(folder, target, megatron)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def check_export(folder: str, target: str, megatron) -> Dict[str, Any]:
    """The exported folder `target` loads in transformers; its weights are the DEL checkpoint's
    (`megatron`, the Megatron model loaded from it) and not the original model's; its logits on
    the training sample and on a second batch match the Megatron model's."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(target).float().eval()
    original = AutoModelForCausalLM.from_pretrained(hf_dir(folder)).float().eval()
    megatron.eval()
    hf_weights = dict(exported.state_dict())
    mc_weights = megatron.state_dict()
    result: Dict[str, Any] = {
        "class": type(exported).__name__,
        "same_as_megatron": {
            hf: bool(torch.equal(hf_weights[hf], mc_weights[mc])) for hf, mc in SAME_WEIGHTS.items()
        },
        "changed_by_training": max(
            float((hf_weights[k] - v).abs().max()) for k, v in original.state_dict().items()
        ),
    }
    tok = tokenizer(folder)
    batch = sample(text_ids(tok))
    g = torch.Generator().manual_seed(1)
    other = torch.randint(0, 20, (2, SEQ), generator=g)
    diffs = []
    for tokens in (batch["tokens"], other):
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            mc_logits = megatron(input_ids=tokens, position_ids=positions, attention_mask=None)
            hf_logits = exported(input_ids=tokens).logits
        diffs.append(float((mc_logits.double() - hf_logits.double()).abs().max()))
    result["logits_max_abs_diff"] = max(diffs)
    result["logit_scale"] = float(hf_logits.abs().max())
    result["exported_ce"] = hf_cross_entropy(exported, batch)
    result["original_ce"] = hf_cross_entropy(original, batch)
    return result


STEPS = {"make": make, "prepare": prepare, "export_and_check": export_and_check}

if __name__ == "__main__":
    STEPS[sys.argv[1]](*sys.argv[2:])
