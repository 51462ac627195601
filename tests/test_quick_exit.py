"""del_megatron.cpu.quick_exit: a CPU job's processes freeze the garbage collector at exit, and keep
their exit status and what they print."""

import subprocess
import sys

import pytest

from del_megatron.cpu.training import job_environment

REPORT = (
    "import atexit, gc, sys\n"
    "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count(), flush=True))\n"
)


@pytest.mark.parametrize("skip", [True, False])
def test_the_last_collections_skip_what_was_alive_and_the_status_is_kept(skip):
    body = REPORT
    if skip:
        body += "from del_megatron.cpu.quick_exit import skip_final_collections\n"
        body += "skip_final_collections(); skip_final_collections()\n"
    body += "print('body done', gc.get_freeze_count(), len(gc.get_objects())); sys.exit(3)\n"
    done = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    ended, at_exit = done.stdout.splitlines()
    _, _, frozen_before, alive = ended.split()
    frozen_at_exit = int(at_exit.removeprefix("frozen at exit: "))
    # skip: about all that lived at the end of the body (the interpreter's start may freeze some)
    if skip:
        assert frozen_at_exit > int(frozen_before) + 0.9 * int(alive), done.stdout
    else:
        assert frozen_at_exit == int(frozen_before), done.stdout


def test_every_process_of_a_cpu_job_registers_it():
    body = "import del_megatron.cpu.quick_exit as q; print(q._registered)"
    env = job_environment({"PATH": "/usr/bin:/bin"})
    done = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True]"
