"""A GGUF file (llama.cpp's format, often 4-bit) as a Hugging Face model folder that
Megatron-Bridge imports: transformers de-quantizes the tensors to fp32 and rebuilds the
tokenizer from the file's metadata. The weights are the quantized ones, de-quantized: close to,
but not, the original model's."""

from __future__ import annotations

import os

import torch


def gguf_to_hf(gguf_file: str, out_dir: str) -> str:
    """Write the model and tokenizer of `gguf_file` to `out_dir` (safetensors, fp32); needs
    transformers with the `gguf` package. Returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_file))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
