"""Bridge's checkpoints of a DEL model: run_config.yaml as Bridge writes it at every save, read
back by load_model_config; save / load of the weights and the export to Hugging Face."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import torch


def run_config_round_trip(state, tok_cfg, folder: str) -> Dict[str, Any]:
    """run_config.yaml as Bridge writes it at every save (with the tokenizer config set on the
    state's ConfigContainer), then load_model_config."""
    import yaml
    from megatron.bridge.training.checkpointing import get_checkpoint_run_config_filename
    from megatron.bridge.training.model_load_save import load_model_config

    ckpt = os.path.join(folder, "iter_0000001")
    os.makedirs(ckpt)
    state.cfg.tokenizer = tok_cfg
    state.cfg.to_yaml(get_checkpoint_run_config_filename(ckpt))
    with open(get_checkpoint_run_config_filename(ckpt)) as f:
        text = f.read()
    saved = yaml.safe_load(text)
    loaded, mlm_args = load_model_config(ckpt)
    return {
        "model_target": saved["model"]["_target_"],
        "del_keys": sorted(k for k in saved["model"] if k.startswith(("numerical", "del_"))),
        "del_in_text": [w for w in ("numerical_loss", "del_alpha", "del_digit") if w in text],
        "loaded_class": f"{type(loaded).__module__}.{type(loaded).__qualname__}",
        "loaded_has_del": hasattr(loaded, "numerical_loss"),
        "hidden_size": loaded.hidden_size,
        "mlm_args": mlm_args is None,
    }


def export_round_trip(bridge, model, folder: str) -> Dict[str, Any]:
    """Bridge's own checkpoint of the DEL-trained model (save_megatron_model: run_config.yaml
    and torch_dist weights), loaded back by load_megatron_model, then exported to Hugging Face
    by save_hf_pretrained, as for any CE model. Each step's failure is reported, not raised."""
    from safetensors.torch import load_file

    report: Dict[str, Any] = {}
    path = os.path.join(folder, "megatron_ckpt")
    try:
        bridge.save_megatron_model([model], path)
        loaded = bridge.load_megatron_model(path, wrap_with_ddp=False)
        report["loaded_config_has_del"] = hasattr(loaded[0].config, "numerical_loss")
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                model.state_dict().values(), loaded[0].state_dict().values(), strict=True
            )
            if isinstance(a, torch.Tensor)
        )
        report["weights_equal"] = same
        hf_path = os.path.join(folder, "hf")
        bridge.save_hf_pretrained(loaded, hf_path)
        with open(os.path.join(hf_path, "config.json")) as f:
            hf_config = json.load(f)
        report["hf_del_keys"] = sorted(k for k in hf_config if k.startswith(("numerical", "del_")))
        report["hf_architectures"] = hf_config.get("architectures")
        shards = [n for n in os.listdir(hf_path) if n.endswith(".safetensors")]
        weights = {}
        for name in shards:
            weights.update(load_file(os.path.join(hf_path, name)))
        embedding = model.embedding.word_embeddings.weight.detach()
        report["hf_embedding_equal"] = bool(
            torch.equal(weights["model.embed_tokens.weight"], embedding)
        )
    except Exception as err:  # noqa: BLE001 - reported to the test
        import traceback

        report["error"] = "".join(traceback.format_exception(err))[-3000:]
    return report
