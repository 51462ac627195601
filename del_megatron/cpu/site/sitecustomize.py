"""Runs at start-up of every Python process with this folder on PYTHONPATH: with
DEL_MEGATRON_CPU=1, in a distributed worker (RANK set: torchrun's workers and what they spawn,
not the torchrun agent), Megatron-LM's training loop runs on CPU (del_megatron.cpu.training)."""

import os

if os.environ.get("DEL_MEGATRON_CPU") == "1" and "RANK" in os.environ:
    from del_megatron.cpu.training import activate

    activate()
