"""Digits: what a tokenizer's numbers are and where they sit in the labels. Torch and the
standard library only; nothing here knows about a framework or the loss.

Modules: number_tokens (the ten digits and a chunking vocabulary's 1,100 number tokens, as
text), tokenizers (the digit and decimal-point ids of a tokenizer file or object, and how it
cuts numbers), tokenizer_types (a tokenizer read as Megatron-LM's --tokenizer-type reads it),
vocab (DigitVocab: the ids the loss acts on), numbers (number runs and place weights in
[b, s] labels, on the device), slots (a chunking vocabulary's slot logits), data_share (the
share of a dataset's label positions that are digit targets).
"""
