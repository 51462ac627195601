"""Continued training of a Hugging Face model on question/answer data through Megatron-Bridge,
one run per loss and seed, scored on held-out problems (`del-megatron compare-qa`): the
evidence on a real pretrained model (docs/results.md, SmolLM2-135M on GSM8K).

Modules: answers (the digit classes of a worked solution), data (question/answer files, Bridge's
fine-tuning layout), gguf_model (a GGUF file as a Hugging Face model), finetune (the torchrun
worker: Bridge's finetune()), convert (Hugging Face to Megatron and back), score (teacher-forced
and greedy scoring), sweep (a resumable compare-qa folder), published (a published result read
back as runs), analysis (per-problem counts, the bootstrap), matched_weight (the control weight
matching a loss's gradient), report (the tables), commands (the parsers of gguf-to-hf,
score-qa, compare-qa, matched-weight)."""
