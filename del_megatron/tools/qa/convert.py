"""Hugging Face <-> Megatron checkpoints for compare-qa, in one process (gloo; Bridge's CPU
runtime where there is no CUDA):

    python -m del_megatron.tools.qa.convert import HF_MODEL MEGATRON_PATH
    python -m del_megatron.tools.qa.convert export HF_MODEL MEGATRON_PATH HF_PATH
"""

from __future__ import annotations

import sys


def main(argv: list) -> None:
    import torch

    from ...cpu import bridge

    if torch.cuda.is_available():
        raise SystemExit("compare-qa converts on CPU; with CUDA use examples/bridge_convert.py")
    bridge.activate()
    bridge.init_single_process()
    direction, *paths = argv
    if direction == "import":
        bridge.import_hf(*paths)
    else:
        bridge.export_hf(*paths)


if __name__ == "__main__":
    main(sys.argv[1:])
