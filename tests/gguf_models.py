"""A tiny random Llama written as GGUF with the `gguf` package's writer (llama.cpp's layout:
byte-level BPE tokenizer in the metadata, Q8_0 matrices, F32 norms, tied embeddings), for the
de-quantization and compare-qa tests without the 98 MB download."""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
MERGES = ("Ġ t", "h e", "Ġt he", "Q u", "A n", "Ġ =")


def _byte_chars() -> list:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_llama(
    path: str,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
) -> Tuple[int, Dict[str, np.ndarray]]:
    """Write the model to `path`; (vocab size, {GGUF tensor name: its values as stored, i.e.
    de-quantized, [out, in]}) for checking a loader against."""
    import gguf

    tokens = list(SPECIALS) + _byte_chars() + [m.replace(" ", "") for m in MERGES]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)

    rng = np.random.default_rng(seed)
    stored: Dict[str, np.ndarray] = {}
    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        data = gguf.quants.quantize(values, q8)
        writer.add_tensor(name, data, raw_dtype=q8)
        stored[name] = gguf.quants.dequantize(data, q8)

    def norm(name: str) -> None:
        values = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        writer.add_tensor(name, values)
        stored[name] = values

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab, stored
