"""CountingEngine: the engine interface the loop needs (`worker.loop.ServedEngine`), scripted.

Each step gives every running request its next integer (1, 2, ...) up to its max_tokens, so a
test knows every token a request must get. `fail_at_step` makes step N raise (a bug in the
engine); `step_gate`, when set, makes each step wait for the test to let it run. A step asks
the loop's `are_aborted` once, as a fused step does between its layers, and is abandoned (no
tokens) when every running request was aborted.
"""

from __future__ import annotations

import threading

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import EngineStats, FinishReason, RequestDelta


class CountingEngine:
    """A stand-in engine with exact, predictable outputs."""

    config = EngineConfig(model="counting")
    max_model_len = 64
    vocab_size = 100
    load_time_s = 0.25
    prepare_time_s = 0.0625
    kv_sizing_time_s = 0.125

    def __init__(self, fail_at_step: int | None = None, fail_warm_up: Exception | None = None):
        self.requests: dict[str, tuple[int, int]] = {}  # id -> (tokens made, max_tokens)
        self.num_steps = 0
        self.num_warm_ups = 0
        self.fail_at_step = fail_at_step
        self.fail_warm_up = fail_warm_up
        self.step_gate: threading.Semaphore | None = None
        self.thread_ids: set[int] = set()  # the threads that called step()
        self.idle_slices = 0  # slices of idle work left (`idle_work`)
        self.idle_work_at_steps: list[int] = []  # num_steps at each idle_work call
        self.abandoned_steps: list[int] = []  # num_steps of the steps abandoned

    def idle_work(self) -> bool:
        self.idle_work_at_steps.append(self.num_steps)
        self.idle_slices = max(0, self.idle_slices - 1)
        return self.idle_slices > 0

    def warm_up(self) -> None:
        self.num_warm_ups += 1
        if self.fail_warm_up is not None:
            raise self.fail_warm_up

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("prompt too long")
        self.requests[request_id] = (0, params.max_tokens)

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self, are_aborted=None) -> list[RequestDelta]:
        if self.step_gate is not None:
            self.step_gate.acquire()
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError(f"step {self.num_steps} broke")
        if are_aborted is not None and are_aborted(list(self.requests)):
            self.abandoned_steps.append(self.num_steps)
            return []
        deltas = []
        for request_id, (num_made, max_tokens) in list(self.requests.items()):
            num_made += 1
            is_done = num_made == max_tokens
            finish = FinishReason.LENGTH if is_done else None
            deltas.append(RequestDelta(request_id, [num_made], finish_reason=finish))
            if is_done:
                del self.requests[request_id]
            else:
                self.requests[request_id] = (num_made, max_tokens)
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests), num_kv_blocks=32, block_size=16)
