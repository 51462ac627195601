"""The compare-qa sweep: a Hugging Face model converted once, scored as it is (the base row),
then per seed and loss continued with Bridge's finetune(), exported back to Hugging Face and
scored (score.py). Every stage leaves a file that marks it done, so a rerun resumes; two
sweeps on the same folder (e.g. one a core, side by side) share the runs, each claiming one at
a time.

Layout: <out>/settings.json, init/ (the converted model), base/score.json,
seed-<S>/data/ (the seed's data order), seed-<S>/<arm>/{train/, hf/, score.json}."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Sequence

from ..demo.compare import Arm
from .data import fitting, read_problems, write_finetuning_root
from .finetune import TRAINED, RunSettings, Schedule
from .report import training_record

SCORE, SETTINGS, CLAIM = "score.json", "settings.json", ".claimed"
CONVERT = "del_megatron.tools.qa.convert"


def _python(*args: str) -> List[str]:
    return [sys.executable, "-W", "ignore", *args]


class Sweep:
    """One compare-qa folder `out`: the model, the training and held-out JSONL files, the
    Schedule every run trains with, the held-out problems scored (`scored` teacher-forced, the
    first `greedy` decoded), torch `threads` a process (0: torch's choice) and the JSONL's
    question and answer `keys`."""

    def __init__(
        self,
        out: str,
        hf_model: str,
        train_file: str,
        test_file: str,
        schedule: Schedule,
        scored: int,
        greedy: int,
        threads: int = 0,
        keys: Sequence[str] = ("question", "answer"),
        log: Callable[[str], None] = print,
    ):
        self.out, self.hf_model = os.path.abspath(out), os.path.abspath(hf_model)
        self.train_file, self.test_file = train_file, test_file
        self.schedule, self.log, self.keys = schedule, log, tuple(keys)
        self.scored, self.greedy = scored, greedy
        self.env = dict(os.environ)
        if threads:
            self.env["OMP_NUM_THREADS"] = str(threads)

    # -- stages -------------------------------------------------------------------------
    def _run(self, command: List[str], log_path: str) -> None:
        with open(log_path, "a") as log:
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if code != 0:
            killed = " (killed: out of memory?)" if code in (-9, 137) else ""
            raise RuntimeError(
                f"{os.path.basename(log_path).split('.')[0]} in {os.path.dirname(log_path)} "
                f"failed (exit {code}{killed}): see {log_path}; rerun the same command to "
                "continue the sweep"
            )

    def check_settings(self) -> None:
        """settings.json holds the sweep's model, data and schedule; a rerun must match it."""
        wanted = {
            "hf_model": self.hf_model,
            "train": os.path.abspath(self.train_file),
            "test": os.path.abspath(self.test_file),
            **asdict(self.schedule),
            "scored": self.scored,
            "greedy": self.greedy,
        }
        wanted.pop("tensor_parallel")
        path = os.path.join(self.out, SETTINGS)
        if os.path.exists(path):
            with open(path) as f:
                before = json.load(f)
            differing = sorted(k for k in wanted if before.get(k) != wanted[k])
            if differing:
                raise ValueError(
                    f"{self.out} holds a sweep with other settings ({', '.join(differing)}): "
                    "give the same settings, or another --out"
                )
            return
        os.makedirs(self.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(wanted, f, indent=1)

    def converted(self) -> str:
        """The Megatron checkpoint of the model, converted once (a sweep beside this one that
        is converting it is waited for)."""
        init = os.path.join(self.out, "init")
        done = os.path.join(init, "latest_checkpointed_iteration.txt")
        while not os.path.exists(done):
            if not self._claim(init):
                time.sleep(5)
                continue
            try:
                self.log(f"converting {self.hf_model} to a Megatron checkpoint")
                command = _python("-m", CONVERT, "import", self.hf_model, init)
                self._run(command, os.path.join(self.out, "convert.log"))
            finally:
                self._release(init)
        return init

    def score(self, hf_model: str, folder: str) -> dict:
        path = os.path.join(folder, SCORE)
        if not os.path.exists(path):
            command = _python("-m", "del_megatron.tools.cli", "score-qa", "--hf-model", hf_model)
            command += ["--data", self.test_file, "--problems", str(self.scored)]
            command += ["--greedy", str(self.greedy), "--out", path]
            command += ["--question-key", self.keys[0], "--answer-key", self.keys[1]]
            self._run(command, os.path.join(folder, "score.log"))
        with open(path) as f:
            return json.load(f)

    def data_root(self, seed: int) -> str:
        root = os.path.join(self.out, f"seed-{seed}", "data")
        if not os.path.exists(os.path.join(root, "validation.jsonl")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.hf_model)
            train = read_problems(self.train_file, *self.keys)
            train = fitting(train, tokenizer, self.schedule.seq_length)
            held_out = read_problems(self.test_file, *self.keys)[:8]
            write_finetuning_root(root, train, held_out, seed)
        return root

    def run(self, arm: Arm, seed: int) -> dict:
        """Train (or continue), export and score one (arm, seed); its score.json."""
        folder = os.path.join(self.out, f"seed-{seed}", arm.name)
        save = os.path.join(folder, "train")
        s = self.schedule
        if not os.path.exists(os.path.join(save, TRAINED)):
            init, data = self.converted(), self.data_root(seed)
            settings = RunSettings(
                self.hf_model, init, data, save, arm.loss, arm.weight, seed, schedule=s
            )
            command = _python("-m", "torch.distributed.run", "--standalone")
            command += [
                "--nproc-per-node",
                str(s.tensor_parallel),
                "-m",
                "del_megatron.tools.qa.finetune",
            ]
            command.append(json.dumps(asdict(settings)))
            self._run(command, os.path.join(folder, "train.log"))
        hf = os.path.join(folder, "hf")
        if not os.path.exists(os.path.join(hf, "config.json")):
            command = _python("-m", CONVERT, "export", self.hf_model, save, hf)
            self._run(command, os.path.join(folder, "convert.log"))
        return self.score(hf, folder)

    # -- the loop ---------------------------------------------------------------------------
    def _claim(self, folder: str) -> bool:
        """Whether this process may work on `folder` (no other live sweep holds it)."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, CLAIM)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    os.kill(int(f.read() or 0), 0)
                return False  # held by a live process
            except (ProcessLookupError, ValueError):
                os.remove(path)  # left by a sweep that stopped
                return self._claim(folder)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True

    def _release(self, folder: str) -> None:
        path = os.path.join(folder, CLAIM)
        if os.path.exists(path):
            os.remove(path)

    def _claimed(self, folder: str, work: Callable[[], dict]) -> Optional[dict]:
        if os.path.exists(os.path.join(folder, SCORE)):
            with open(os.path.join(folder, SCORE)) as f:
                return json.load(f)
        if not self._claim(folder):
            return None
        try:
            return work()
        finally:
            self._release(folder)

    def all(
        self,
        arms: Sequence[Arm],
        seeds: Sequence[int],
        done: Optional[Dict[str, Dict[int, dict]]] = None,
    ) -> Dict[str, Dict[int, dict]]:
        """Every stage not done (and not held by another sweep, nor among the runs `done`
        elsewhere: {arm: {seed: score}}); {arm: {seed: score}}, and "base": {0: score}, for the
        runs this folder finished so far."""
        done = done or {}
        self.check_settings()
        self.converted()
        base = os.path.join(self.out, "base")
        todo = [("base", 0, base, lambda: self.score(self.hf_model, base))]
        for seed in seeds:
            for arm in arms:
                if seed in done.get(arm.name, {}):
                    continue
                folder = os.path.join(self.out, f"seed-{seed}", arm.name)
                todo.append((arm.name, seed, folder, lambda a=arm, s=seed: self.run(a, s)))
        results: Dict[str, Dict[int, dict]] = {}
        for number, (name, seed, folder, work) in enumerate(todo, 1):
            self.log(
                f"[{number}/{len(todo)}] {name}" + (f", seed {seed}" if name != "base" else "")
            )
            score = self._claimed(folder, work)
            if score is None:
                self.log("  held by another sweep: skipped")
                continue
            if name != "base":
                score = {**score, **training_record(os.path.join(folder, "train"))}
            results.setdefault(name, {})[seed] = score
        return results
