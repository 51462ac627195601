"""del_megatron.cpu.rendezvous: each torchrun restart attempt rendezvouses in its own key space
of the agent's store (the killed round's keys would send gloo to dead peers)."""

import datetime
import inspect

import pytest
import torch.distributed as dist

from del_megatron.cpu.rendezvous import per_attempt


def init_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name="",
    pg_options=None,
    device_id=None,
):
    """torch.distributed.init_process_group's public parameters; records a call's values."""
    init_process_group.calls.append(dict(locals()))


@pytest.fixture
def recorded():
    init_process_group.calls = []
    return init_process_group


@pytest.fixture
def agent_store(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    return server


def test_the_stand_in_takes_torchs_public_parameters_in_order():
    ours = list(inspect.signature(init_process_group).parameters)
    assert list(inspect.signature(dist.init_process_group).parameters)[: len(ours)] == ours


def test_under_the_agent_each_attempt_has_its_own_keys(recorded, agent_store):
    timeout = datetime.timedelta(seconds=20)
    per_attempt(recorded)("gloo", timeout=timeout)
    (call,) = recorded.calls
    assert (call["backend"], call["rank"], call["world_size"]) == ("gloo", 1, 2)
    assert call["init_method"] is None and call["timeout"] == timeout
    call["store"].set("rank_0", "new address")
    assert agent_store.get("del_megatron/attempt_3/rank_0") == b"new address"
    assert not agent_store.check(["rank_0"])


def test_env_init_method_and_explicit_ranks_are_kept(recorded, agent_store):
    per_attempt(recorded)(backend="gloo", init_method="env://", rank=0, world_size=4)
    (call,) = recorded.calls
    assert (call["rank"], call["world_size"], call["init_method"]) == (0, 4, None)
    assert isinstance(call["store"], dist.PrefixStore)


@pytest.mark.parametrize(
    "env, kwargs",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, {}),  # rank 0 hosts the store
        ({}, {"init_method": "tcp://127.0.0.1:1"}),
        ({}, {"store": "a store of the caller's"}),
    ],
)
def test_other_rendezvous_are_left_alone(recorded, agent_store, monkeypatch, env, kwargs):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    per_attempt(recorded)("gloo", **kwargs)
    (call,) = recorded.calls
    assert call["store"] == kwargs.get("store") and call["rank"] == -1
    assert call["init_method"] == kwargs.get("init_method")


def test_outside_torchrun_nothing_changes(recorded, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    per_attempt(recorded)("gloo")
    assert recorded.calls[0]["store"] is None
