"""`python -m del_megatron ...` runs the `del-megatron` command."""

import sys

from .tools.cli import main

sys.exit(main())
