"""`python -m benchmarks.gpu_check` (what gpu_check.sh runs), or `python benchmarks/gpu_check`
(how the driver starts each stage's process, from any working directory)."""

import sys
from pathlib import Path

if not __package__:  # run as a directory: the repository root, not this folder, goes first
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.gpu_check.cli import main  # noqa: E402
from del_megatron.cpu.quick_exit import skip_final_collections  # noqa: E402

if __name__ == "__main__":
    skip_final_collections()
    sys.exit(main())
