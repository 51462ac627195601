"""The CPU demo: a number-rich corpus, a Megatron indexed dataset, and a small GPTModel trained
with cross-entropy and with DEL from the same seed, then evaluated on held-out problems."""
