"""DataParallelClient's own rules, without worker processes: when the group is ready, and which
engine a request goes to under each routing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nanoserve.client.data_parallel import DataParallelClient, make_engine_client
from nanoserve.client.engine_client import EngineDeadError
from nanoserve.client.zmq_engine_client import ZmqEngineClient
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import Ready

READY = Ready(1, 1024, 300, 64, 16, 0.0, 0.0, 0.0)
PROMPT = list(range(64))  # four full blocks


@pytest.fixture
def make_client() -> Iterator:
    clients: list[DataParallelClient] = []

    def make(routing: str = "prefix", size: int = 2) -> DataParallelClient:
        config = EngineConfig(model="m", data_parallel_size=size)
        clients.append(DataParallelClient(config, routing=routing))
        return clients[-1]

    yield make
    for client in clients:
        for engine in client.engines:
            engine._ipc.cleanup()


def set_ready(client: DataParallelClient, index: int, is_ready: bool = True) -> None:
    engine = client.engines[index]
    engine._is_ready = is_ready
    if is_ready:
        client._engine_ready(engine, READY)


def test_ready_once_every_engine_started_then_while_any_is(make_client) -> None:
    client = make_client()
    assert [e.config.data_parallel_rank for e in client.engines] == [0, 1]
    assert client.num_engines == 2 and not client.is_ready
    set_ready(client, 0)
    assert not client.is_ready  # start-up waits for every engine
    set_ready(client, 1)
    assert client.is_ready and client.info == READY
    set_ready(client, 0, False)  # one engine restarting: the other serves
    assert client.is_ready
    set_ready(client, 1, False)
    assert not client.is_ready
    with pytest.raises(EngineDeadError):
        client.choose_engine(PROMPT)


def test_round_robin_takes_turns_among_ready_engines(make_client) -> None:
    client = make_client("round-robin", size=3)
    for index in range(3):
        set_ready(client, index)
    assert [client.choose_engine(PROMPT).engine_index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    set_ready(client, 1, False)
    assert [client.choose_engine(PROMPT).engine_index for _ in range(4)] == [0, 2, 0, 2]


def test_least_loaded_ignores_prefixes(make_client) -> None:
    client = make_client("least-loaded")
    set_ready(client, 0)
    set_ready(client, 1)
    client.engines[0]._streams = {"a": None, "b": None}  # type: ignore[dict-item]
    assert client.choose_engine(PROMPT).engine_index == 1
    assert client.num_in_flight == 2


def test_a_restarted_engine_loses_its_prefixes(make_client) -> None:
    client = make_client()
    set_ready(client, 0)
    set_ready(client, 1)
    client.router.record(PROMPT, 1)
    assert client.choose_engine(PROMPT).engine_index == 1
    set_ready(client, 1)  # a new worker: an empty cache
    assert client.router.choose(PROMPT, [1, 0], [True, True]) == 1  # by load only now
    assert client.router.choose(PROMPT, [0, 1], [True, True]) == 0


def test_one_engine_is_a_plain_client() -> None:
    client = make_engine_client(EngineConfig(model="m"))
    try:
        assert isinstance(client, ZmqEngineClient) and client.num_engines == 1
    finally:
        client._ipc.cleanup()
    with pytest.raises(ValueError, match="routing must be one of"):
        DataParallelClient(EngineConfig(model="m", data_parallel_size=2), routing="random")


def test_each_engine_ready_is_reported(make_client) -> None:
    client = make_client(size=2)
    reported: list[Ready] = []
    client.on_ready = reported.append  # the server's metrics learn max_model_len from it
    set_ready(client, 0)
    set_ready(client, 1)
    assert reported == [READY, READY]
