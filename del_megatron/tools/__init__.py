"""Tools: the `del-megatron` command and what it runs. A training job never imports them.

Modules: cli (the command line), preflight (`del-megatron check`: a tokenizer's digit ids,
the weight for its family, the flags to add, a dataset's digit share), demo/ (the CPU demo and
`del-megatron compare`: a small Megatron-Core GPT trained with each loss), qa/ (`compare-qa`,
`score-qa`, `matched-weight`, `gguf-to-hf`: a Hugging Face model continued on question/answer
data through Megatron-Bridge and scored).
"""
