"""python -m tests.bridge_workers <check> <out.json>: one check, its results to out.json."""

import sys

from .bridge import check_bridge
from .nemo import check_nemo

CHECKS = {"bridge": check_bridge, "nemo": check_nemo}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](sys.argv[2])
