"""Megatron-LM's pretrain_gpt.py with the del_megatron numerical losses: the drop-in.

Run it from a Megatron-LM checkout (or with MEGATRON_LM_DIR naming one) exactly like
pretrain_gpt.py, as a module of the installed package, with the extra flags:

    cd Megatron-LM
    torchrun ... -m del_megatron.megatron.pretrain_gpt_del <usual pretrain_gpt.py flags> \\
        --numerical-loss del --del-alpha 0.1

and for the token reduction, the share `del-megatron check --data-path` measured (0.05 here):

    torchrun ... -m del_megatron.megatron.pretrain_gpt_del <usual pretrain_gpt.py flags> \\
        --numerical-loss del --del-alpha 0.1 --del-reduction token --del-digit-share 0.05

(examples/pretrain_gpt_del.py is the same, by path.) Digit ids come from the run's tokenizer
unless --del-digit-token-ids is given.
It imports Megatron-LM's own pretrain_gpt.py as a module (its main does not run) and calls
`pretrain()` as that main does, in each release's argument API (entry.py: one mechanism for
pretrain_gpt.py, pretrain_hybrid.py and pretrain_mamba.py). Tested against
Megatron-LM core_v0.16.1, core_v0.18.0 and core_v0.19.0 and the development heads main and dev
(tests/e2e, docs/testing.md). It may also be launched from a tree that our patch already
changed: each of its wrappers then acts once.
"""

from del_megatron.megatron.entry import SCRIPTS, run


def main() -> None:
    run(SCRIPTS["pretrain_gpt"])


if __name__ == "__main__":
    main()
