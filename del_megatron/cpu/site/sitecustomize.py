"""Runs at start-up of every Python process with this folder on PYTHONPATH: with
DEL_MEGATRON_CPU=1, Megatron-LM's training loop runs on CPU in this process and in the ones it
starts (del_megatron.cpu.training). The torchrun agent gets it too, and never uses it."""

import os

if os.environ.get("DEL_MEGATRON_CPU") == "1":
    from del_megatron.cpu.training import activate

    activate()
