"""The CPU demo: a number-rich corpus, a Megatron indexed dataset, and a small GPTModel trained
with cross-entropy and with DEL from the same seed, then evaluated on held-out problems.

Modules: corpus (the synthetic problems), text_tokenizer (their tokenizer), data (the indexed
dataset), config (a run's settings), train (one run), continued (a run from a CE base),
evaluate (held-out metrics), digit_shape (the digit distributions' shape), stats (means,
intervals, paired differences), compare (`del-megatron compare`: every loss x seeds), report
(its tables and figures)."""
