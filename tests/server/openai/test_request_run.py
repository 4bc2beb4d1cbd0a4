"""A run from its start to its last burst, against the real EngineClient routing with the test
playing the engine: a constrained run waits for the engine's first word (a grammar that did not
compile is a 400 naming its field, and nothing is left in flight), an unconstrained one does
not, and a delta taken early never shares a burst with a later one of its choice."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from starlette.requests import Request
from transformers import PreTrainedTokenizerFast

from nanoserve.client.engine_client import EngineClient
from nanoserve.common.protocol import (
    AddRequest,
    EngineStats,
    FinishReason,
    Ready,
    RequestDelta,
    StepOutputs,
)
from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.openai.constraints import Constraint
from nanoserve.server.openai.request_run import RequestRun, start_run
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.tokenizer_pool import TokenizerPool
from nanoserve.text.byte_tokenizer import build_byte_level_tokenizer

PROMPT = list(b"hi")
REGEX = Constraint(StructuredOutputsParams(regex="[a-z]+"), "guided_regex")


class PlayedEngineClient(EngineClient):
    """An EngineClient whose messages go to a list: the test answers as the engine would."""

    def __init__(self) -> None:
        super().__init__()
        self.info = Ready(1, 64, 256, 16, 16, 0.0, 0.0, 0.0)
        self._is_ready = True
        self.sent: list[msgspec.Struct] = []

    def _send(self, message: msgspec.Struct) -> bool:
        self.sent.append(message)
        return True

    def step(self, *deltas: RequestDelta) -> None:
        self._on_message(StepOutputs(deltas=list(deltas), stats=EngineStats()))

    def added_ids(self) -> list[str]:
        return [m.request_id for m in self.sent if isinstance(m, AddRequest)]


@pytest.fixture
def model():
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_byte_level_tokenizer())
    pool = TokenizerPool(tokenizer)
    config = ServerConfig(model="m", served_model_names=("m",))
    yield ServedModel(config, PlayedEngineClient(), pool, ServerMetrics("m"))
    pool.shutdown()


def http_request() -> Request:
    """A request whose client stays connected."""

    async def receive() -> dict:
        await asyncio.Event().wait()  # never a disconnect
        return {}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def delta(request_id: str, text: str, finish: FinishReason | None = None) -> RequestDelta:
    return RequestDelta(request_id, list(text.encode()), finish_reason=finish)


async def bursts(run: RequestRun) -> list[list[tuple[int, str]]]:
    return [[(u.choice.index, u.text) for u in burst] async for burst in run.updates()]


def test_a_constrained_run_whose_grammar_failed_is_a_400_naming_its_field(
    model: ServedModel,
) -> None:
    client = model.client
    assert isinstance(client, PlayedEngineClient)
    params = SamplingParams(n=2, max_tokens=5, structured_outputs=REGEX.params)

    async def scenario() -> None:
        start = asyncio.ensure_future(
            start_run(model, http_request(), [PROMPT], [params], "cmpl", REGEX)
        )
        while len(client.added_ids()) < 2:  # both choices reach the engine first
            await asyncio.sleep(0)
        assert not start.done()  # waiting for the engine's first event
        error = "invalid structured output regex: bad"
        failed = [
            RequestDelta(i, [], finish_reason=FinishReason.ABORT, error=error)
            for i in client.added_ids()
        ]
        client.step(*failed)
        with pytest.raises(APIError) as refused:
            await start
        assert (refused.value.status_code, refused.value.param) == (400, "guided_regex")
        assert "regex: bad" in refused.value.message

    asyncio.run(scenario())
    assert client.num_in_flight == 0


def test_an_unconstrained_run_starts_before_the_engine_answers(model: ServedModel) -> None:
    client = model.client
    assert isinstance(client, PlayedEngineClient)
    params = SamplingParams(max_tokens=5)

    async def scenario() -> RequestRun:
        return await asyncio.wait_for(
            start_run(model, http_request(), [PROMPT], [params], "cmpl", None), timeout=30
        )

    run = asyncio.run(scenario())
    assert client.added_ids() == [f"{run.request_id}-0"] and client.num_in_flight == 1
    run.close()
    assert client.num_in_flight == 0


def test_the_first_delta_taken_early_is_a_burst_of_its_own(model: ServedModel) -> None:
    client = model.client
    assert isinstance(client, PlayedEngineClient)
    params = SamplingParams(n=2, max_tokens=5, structured_outputs=REGEX.params)

    async def scenario() -> list[list[tuple[int, str]]]:
        start = asyncio.ensure_future(
            start_run(model, http_request(), [PROMPT], [params], "cmpl", REGEX)
        )
        while len(client.added_ids()) < 2:
            await asyncio.sleep(0)
        first, second = client.added_ids()
        client.step(delta(first, "a"))
        run = await start
        # Before the run is read: a later delta of the same choice, and the other choice's.
        client.step(delta(first, "b"), delta(second, "x"))
        client.step(delta(first, "c", FinishReason.STOP), delta(second, "y", FinishReason.STOP))
        return await bursts(run)

    assert asyncio.run(scenario()) == [[(0, "a")], [(0, "bc"), (1, "xy")]]
