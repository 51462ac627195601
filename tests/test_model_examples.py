"""docker/examples' argument sets describe the models they name: each set's flags, as the script
hands them to pretrain_gpt.py, go through Megatron-LM's own parse_args and validate_args (with
our flags), become a TransformerConfig by Megatron-LM's core_transformer_config_from_args, and
build a GPTModel on the meta device; its parameter count and shapes are held to the published
Hugging Face configs (megatron-core 0.19's megatron.training: collected where it imports)."""

import os
import sys

import pytest
import torch

from del_megatron.megatron.lm import add_arguments

from .test_continued_pretraining import ROOT, run_example

# Published Hugging Face configs (config.json) and parameter counts (safetensors index totals).
PUBLISHED = {
    "llama3.1-8b.sh": dict(
        params=8_030_261_248,
        vocab=128256,
        eps=1e-5,
        rope_base=500000,
        kv_heads=8,
        ffn=14336,
        qkv_bias=False,
        rope_scaling=True,
    ),
    "qwen2.5-7b.sh": dict(
        params=7_615_616_512,
        vocab=152064,
        eps=1e-6,
        rope_base=1000000,
        kv_heads=4,
        ffn=18944,
        qkv_bias=True,
        rope_scaling=False,
    ),
    "llama2-7b.sh": dict(
        params=6_738_415_616,
        vocab=32000,
        eps=1e-5,
        rope_base=10000,
        kv_heads=32,
        ffn=11008,
        qkv_bias=False,
        rope_scaling=False,
    ),
    "mistral-7b.sh": dict(
        params=7_241_732_096,
        vocab=32000,
        eps=1e-5,
        rope_base=10000,
        kv_heads=8,
        ffn=14336,
        qkv_bias=False,
        rope_scaling=False,
    ),
}


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from del_megatron.cpu.ports import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


def megatron_args(script: str, tmp_path, monkeypatch):
    """The script's flags through Megatron-LM's parse_args and validate_args, as a job of
    tensor x pipeline x 2 ranks on a Hopper GPU would see them."""
    from megatron.training import arguments

    code, stderr, argv = run_example(
        ROOT / "docker/examples" / script,
        tmp_path,
        CHECKPOINT_DIR=str(tmp_path / "c"),
        FROM_SCRATCH="1",
    )
    assert code == 0, stderr
    flags = argv[1:]
    tp = int(flags[flags.index("--tensor-model-parallel-size") + 1])
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    monkeypatch.setenv("WORLD_SIZE", str(tp * pp * 2))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # no GPU to ask
    args = arguments.parse_args(extra_args_provider=add_arguments)
    arguments.validate_args(args)
    return args


@pytest.mark.parametrize("script", sorted(PUBLISHED))
def test_argument_set_builds_the_published_model(script, tmp_path, monkeypatch, one_rank):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    want = PUBLISHED[script]
    args = megatron_args(script, tmp_path, monkeypatch)
    assert args.layernorm_epsilon == want["eps"] and args.rotary_base == want["rope_base"]
    kv_heads = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    assert kv_heads == want["kv_heads"] and args.ffn_hidden_size == want["ffn"]
    assert args.add_qkv_bias == want["qkv_bias"] and args.use_rope_scaling == want["rope_scaling"]
    assert args.numerical_loss == "del" and args.untie_embeddings_and_output_weights
    args.apply_rope_fusion = False  # Transformer Engine's kernel: not on this machine
    config = core_transformer_config_from_args(args)
    # the whole model on one rank, no fused kernels, no memory
    config.tensor_model_parallel_size = config.pipeline_model_parallel_size = 1
    config.sequence_parallel = config.persist_layer_norm = False
    config.gradient_accumulation_fusion = False
    config.use_cpu_initialization, config.perform_initialization = True, False
    with torch.device("meta"):
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization=args.normalization),
            vocab_size=want["vocab"],  # the tokenizer's: Megatron-LM pads it (below)
            max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=False,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
        )
    assert sum(p.numel() for p in model.parameters()) == want["params"]
    hidden, heads = args.hidden_size, args.num_attention_heads
    head_dim = hidden // heads
    layer = model.decoder.layers[0]
    assert layer.self_attention.linear_qkv.weight.shape == (
        (heads + 2 * want["kv_heads"]) * head_dim,
        hidden,
    )
    assert (layer.self_attention.linear_qkv.bias is not None) == want["qkv_bias"]
    assert layer.mlp.linear_fc1.weight.shape == (2 * want["ffn"], hidden)
    assert model.output_layer.weight.shape == (want["vocab"], hidden)
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP; the converted checkpoint too
    padded = -(-want["vocab"] // (128 * args.tensor_model_parallel_size))
    assert padded * 128 * args.tensor_model_parallel_size - want["vocab"] < 512
