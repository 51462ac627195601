"""Continued training of a Hugging Face model on question/answer data through Megatron-Bridge,
one run per loss and seed, scored on held-out problems (`del-megatron compare-qa`): the
evidence on a real pretrained model (docs/results.md, SmolLM2-135M on GSM8K)."""
