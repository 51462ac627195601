"""Megatron-Bridge 0.6.2 and NeMo 2.7.0 checks, run in a fresh process each (python -m
tests.bridge_workers <check> <out.json>): Bridge's import alone takes a minute on 2 cores, and
the CPU shim changes torch.cuda for the process, so the pytest process stays clean. The
Transformer Engine placeholder and Bridge's loop on CPU: del_megatron.cpu.bridge.

Modules: fixtures (the shared set-up), bridge (the Bridge check) with forward_step,
checkpoints and configs (its parts), nemo (the NeMo check).
"""
