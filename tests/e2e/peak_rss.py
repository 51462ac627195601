"""Run a command and print, after it, the peak resident set size of its largest process
(torchrun's workers included: each parent folds the peaks of the children it reaps into its own).
On CPU this is the memory figure both the logits-free and the materialised runs share."""

import resource
import subprocess
import sys

PREFIX = "del-megatron e2e: peak RSS of the largest process (MiB):"

if __name__ == "__main__":
    code = subprocess.call(sys.argv[1:])
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"{PREFIX} {peak_kib / 1024:.0f}", flush=True)
    sys.exit(code)
