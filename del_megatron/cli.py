"""`del-megatron`: prepare a number-rich Megatron dataset, and run the CPU demo (CE vs DEL).

del-megatron prepare --out data/             # synthetic corpus, trained SentencePiece
del-megatron demo --out runs/demo            # prepare + train CE and DEL (torchrun, TP=2)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from dataclasses import fields
from typing import List, Optional

from .demo.train import TrainConfig


def _add_train_args(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig(data_dir="", out_dir="")
    for f in fields(TrainConfig):
        if f.name in ("data_dir", "out_dir", "loss", "resume", "progress"):
            continue
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(defaults, f.name)),
            default=getattr(defaults, f.name),
        )


def _prepare(args) -> int:
    from .demo.data import prepare

    meta = prepare(args.out, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.seed)
    print(json.dumps(meta))
    return 0


def _train(args) -> int:
    import torch.distributed as dist

    from .demo.train import train

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    _init_process_group()
    try:
        train(TrainConfig(**values))
    finally:
        dist.destroy_process_group()
    return 0


def _init_process_group() -> None:
    """gloo process group. Under a torchrun agent the rendezvous store outlives a restart, and
    the keys the killed round wrote there would send the new workers to dead peers: each
    attempt gets its own key prefix."""
    import datetime

    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(minutes=5),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"del_megatron/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def _torchrun(nproc: int, argv: List[str]) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "del_megatron.cli",
        *argv,
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo(args) -> int:
    from .demo.data import prepare
    from .demo.report import plot, table, write_results

    data_dir = os.path.join(args.out, "data")
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        prepare(data_dir, args.corpus, args.tokenizer, args.num_docs, args.num_eval, args.seed)
    runs = {}
    for loss in args.losses:
        out_dir = os.path.join(args.out, loss)
        train_args = ["train", "--data-dir", data_dir, "--out-dir", out_dir, "--loss", loss]
        for f in fields(TrainConfig):
            if f.name not in ("data_dir", "out_dir", "loss", "resume", "progress"):
                train_args += [f"--{f.name.replace('_', '-')}", str(getattr(args, f.name))]
        if args.resume:
            train_args.append("--resume")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        code = subprocess.call(_torchrun(args.nproc, train_args), env=env)
        if code != 0:
            print(f"training with loss {loss!r} failed (exit {code})", file=sys.stderr)
            return code
        with open(os.path.join(out_dir, "metrics.json")) as fh:
            runs[loss] = json.load(fh)
    if not all(run["finished"] for run in runs.values()):
        print("stopped before the last step; rerun with --resume to continue", file=sys.stderr)
        return 0
    path = write_results(args.out, runs)
    png = plot(args.out, runs)
    print(table(runs))
    print(f"wrote {path} and {png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="del-megatron", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def data_args(p):
        p.add_argument(
            "--corpus", default=None, help='JSONL with a "text" per line (default: synthetic)'
        )
        p.add_argument(
            "--tokenizer", default=None, help="tokenizer file (default: train SentencePiece)"
        )
        p.add_argument("--num-docs", type=int, default=20000)
        p.add_argument("--num-eval", type=int, default=128)

    prep = sub.add_parser("prepare", help="write the corpus as a Megatron indexed dataset")
    prep.add_argument("--out", required=True)
    prep.add_argument("--seed", type=int, default=1234)
    data_args(prep)
    prep.set_defaults(func=_prepare)

    demo = sub.add_parser("demo", help="train CE and DEL on CPU with torchrun and compare")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument(
        "--losses",
        nargs="+",
        default=["ce", "del"],
        choices=["ce", "del", "ntl_was", "ntl_mse", "dist2"],
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes = tensor-parallel size")
    demo.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    data_args(demo)
    _add_train_args(demo)
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="one training run (the torchrun worker)")
    train.add_argument("--data-dir", required=True)
    train.add_argument("--out-dir", required=True)
    train.add_argument("--loss", default="del")
    train.add_argument("--resume", action="store_true")
    train.add_argument("--no-progress", dest="progress", action="store_false")
    _add_train_args(train)
    train.set_defaults(func=_train)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    # megatron-core says so on import when apex / Transformer Engine (GPU-only) are absent
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"del-megatron {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
