"""Megatron-LM's pretrain_hybrid.py with the del_megatron numerical losses: the drop-in, by path.

The drop-in itself is the installed package's module del_megatron.megatron.pretrain_hybrid_del;
from a Megatron-LM checkout (or with MEGATRON_LM_DIR naming one) these two are the same:

    torchrun ... -m del_megatron.megatron.pretrain_hybrid_del <usual pretrain_hybrid.py flags> \
        --numerical-loss del --del-alpha 0.1
    torchrun ... /path/to/del-megatron/examples/pretrain_hybrid_del.py <the same flags>

docs/megatron-lm.md ("Hybrid models") says what it does with each Megatron-LM release.
"""

from del_megatron.megatron.pretrain_hybrid_del import main

if __name__ == "__main__":
    main()
