"""`python -m del_megatron.cpu --site-dir`: the folder to prepend to PYTHONPATH, with
DEL_MEGATRON_CPU=1, so that Megatron-LM's pretrain() runs on CPU in every process of a job."""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m del_megatron.cpu", description=__doc__)
    parser.add_argument("--site-dir", action="store_true", help="print the folder and exit")
    parser.parse_args()
    print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "site"))


if __name__ == "__main__":
    main()
