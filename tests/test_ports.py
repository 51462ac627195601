"""free_port: a bindable port outside the kernel's ephemeral range, distinct across processes."""

import socket
import subprocess
import sys
from pathlib import Path

from del_megatron.cpu import ports


def test_ephemeral_range_reads_the_kernel_file_and_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == ports.DEFAULT_EPHEMERAL
    f.write_text("garbage")
    assert ports.ephemeral_range(str(f)) == ports.DEFAULT_EPHEMERAL


def test_candidates_lie_outside_the_ephemeral_range():
    assert ports.candidate_ports((32768, 60999)) == range(15000, 32768)
    # A range that starts low leaves the ports above it.
    assert ports.candidate_ports((15500, 60000)) == range(60001, 65536)
    assert ports.candidate_ports((1024, 65000)) == range(0, 0)


def test_free_port_is_bindable_and_not_ephemeral():
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "candidate_ports", lambda _: range(taken, taken + 1))
        port = ports.free_port()
    assert port != taken


def test_processes_seeded_alike_get_different_ports():
    # The global `random` is seeded the same in every worker; free_port must not follow it.
    code = "import random, runpy; random.seed(0); runpy.run_path(%r, run_name='__main__')"
    code %= ports.__file__
    got = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(4)}
    assert len(got) > 1


def test_the_module_runs_as_a_script_without_the_package():
    script = Path(ports.__file__)
    out = subprocess.check_output([sys.executable, "-S", "-I", str(script)], text=True)
    low, high = ports.ephemeral_range()
    assert not low <= int(out) <= high
