"""docker/examples' argument sets describe the models they name: each set's flags, as the script
hands them to pretrain_gpt.py (pretrain_hybrid.py for Nemotron-H), go through Megatron-LM's own
parse_args and validate_args (with our flags), become a TransformerConfig by Megatron-LM's
core_transformer_config_from_args, and build a GPTModel (HybridModel) on the meta device; its
parameter count and shapes are held to the published Hugging Face configs (megatron-core 0.19's
megatron.training: collected where it imports)."""

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
    flags = argv[2:] if argv[0] == "-m" else argv[1:]  # a drop-in module, or the script
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


class GatedRMSNormWeights(torch.nn.Module):
    """The parameters of mamba_ssm's gated RMSNorm (ops/triton/layernorm_gated.RMSNorm): one
    weight of `hidden_size`, no bias; its forward (a Triton kernel) is never run here."""

    def __init__(
        self,
        hidden_size: int,
        eps=1e-5,
        group_size=None,
        norm_before_gate=True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))


# nvidia/Nemotron-H-8B-Base-8K's config.json and its checkpoint's parameter count: 52 layers of
# the pattern below (24 Mamba-2, 4 attention, 24 MLP), untied embeddings, no vocab padding.
NEMOTRON_H_8B = dict(
    params=8_100_852_736,
    vocab=131072,
    pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    mamba=dict(heads=128, head_dim=64, state=128, groups=8),
    kv_heads=8,
    ffn=21504,
    eps=1e-5,
)


def test_the_nemotron_h_argument_set_builds_the_published_model(tmp_path, monkeypatch, one_rank):
    """HybridModel from docker/examples/nemotron-h-8b.sh's flags, with Megatron-Core's local
    modules where its own spec has Transformer Engine's (the same parameters: TE's fused
    norm-and-linear holds the norm's weight). MambaMixer needs mamba_ssm only for its gated
    RMSNorm (a Triton kernel, not installed here): GatedRMSNormWeights stands in for it with
    the same parameter."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    from del_megatron.cpu import install, seed

    want = NEMOTRON_H_8B
    args = megatron_args("nemotron-h-8b.sh", tmp_path, monkeypatch)
    assert args.hybrid_layer_pattern == want["pattern"] and args.num_layers == 52
    assert (args.mamba_num_heads, args.mamba_head_dim) == (128, 64)
    assert (args.mamba_state_dim, args.mamba_num_groups) == (128, 8)
    assert args.num_query_groups == want["kv_heads"] and args.ffn_hidden_size == want["ffn"]
    assert args.squared_relu and args.normalization == "RMSNorm" and args.layernorm_epsilon == 1e-5
    assert args.position_embedding_type == "none" and args.untie_embeddings_and_output_weights
    assert args.numerical_loss == "del"
    config = core_transformer_config_from_args(args)
    config.tensor_model_parallel_size = config.pipeline_model_parallel_size = 1
    config.sequence_parallel = config.persist_layer_norm = False
    config.gradient_accumulation_fusion = False
    config.use_cpu_initialization, config.perform_initialization = True, False
    local = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    norm = local.input_layernorm
    monkeypatch.setattr(hybrid_block, "TENorm", norm)  # the stack's final norm
    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", True)
    monkeypatch.setattr(mamba_mixer, "ExtendedRMSNorm", GatedRMSNormWeights)
    install()
    seed(1)
    mamba = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(
                module=mamba_mixer.MambaMixer,
                submodules=mamba_mixer.MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=local.self_attn_bda,
        ),
    )
    attention = TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=local.self_attention, self_attn_bda=local.self_attn_bda
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda
    )
    stack = ModuleSpec(
        module=hybrid_block.HybridStack,
        submodules=hybrid_block.HybridStackSubmodules(
            mamba_layer=mamba,
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )
    with torch.device("meta"):
        model = HybridModel(
            config,
            stack,
            vocab_size=want["vocab"],
            max_sequence_length=args.max_position_embeddings,
            hybrid_layer_pattern=args.hybrid_layer_pattern,
            share_embeddings_and_output_weights=False,
            position_embedding_type=args.position_embedding_type,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    d_inner = want["mamba"]["heads"] * want["mamba"]["head_dim"]
    layers = model.decoder.layers
    mixers = [layer.mixer for layer in layers if isinstance(layer, MambaLayer)]
    assert len(mixers) == want["pattern"].count("M") == 24
    assert sum(isinstance(layer, MLPLayer) for layer in layers) == 24
    assert sum(p.numel() for p in model.parameters()) == want["params"]
    assert mixers[0].norm.weight.shape == (d_inner,)
    groups, state = want["mamba"]["groups"], want["mamba"]["state"]
    heads = want["mamba"]["heads"]
    assert mixers[0].in_proj.weight.shape == (2 * d_inner + 2 * groups * state + heads, 4096)
    assert model.output_layer.weight.shape == (want["vocab"], 4096)
    assert want["vocab"] % (128 * args.tensor_model_parallel_size) == 0  # no padding
