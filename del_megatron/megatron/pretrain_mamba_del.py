"""Megatron-LM's pretrain_mamba.py with the del_megatron numerical losses: the drop-in.

Run it from a Megatron-LM checkout (or with MEGATRON_LM_DIR naming one) exactly like
pretrain_mamba.py, as a module of the installed package, with the extra flags:

    cd Megatron-LM
    torchrun ... -m del_megatron.megatron.pretrain_mamba_del <usual pretrain_mamba.py flags> \\
        --numerical-loss del --del-alpha 0.1

MambaModel at core_v0.16.1; from core_v0.18.0 pretrain_mamba.py runs pretrain_hybrid.py, and so
does this drop-in.
It imports Megatron-LM's own pretrain_mamba.py as a module (its main does not run) and calls
`pretrain()` as that main does, in each release's argument API (entry.py: one mechanism for
pretrain_gpt.py, pretrain_hybrid.py and pretrain_mamba.py). Tested against Megatron-LM
core_v0.16.1 to core_v0.19.0 and the development heads (tests/e2e/test_hybrid.py).
"""

from del_megatron.megatron.entry import SCRIPTS, run


def main() -> None:
    run(SCRIPTS["pretrain_mamba"])


if __name__ == "__main__":
    main()
