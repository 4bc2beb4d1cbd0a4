"""The loop's inbox (`worker/inbox.py`): messages read ahead for a running step are kept, in
order, for the loop; a step is abandoned only when every one of its requests was aborted."""

from __future__ import annotations

from nanoserve.common.protocol import AbortRequests, AddRequest, Shutdown
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.worker.inbox import Inbox


def scripted(messages: list) -> Inbox:
    """An inbox over `messages` (then nothing), recording each recv's timeout."""
    return Inbox(lambda timeout_s: messages.pop(0) if messages else None)


def add(request_id: str) -> AddRequest:
    return AddRequest(request_id, [1, 2], SamplingParams(max_tokens=2), 0.0)


def test_messages_read_ahead_come_back_in_order_before_new_ones():
    waiting = [AbortRequests(["a"]), add("b")]
    inbox = scripted(waiting)
    assert inbox.are_aborted(["a"])
    assert waiting == []  # both were read, and are kept
    waiting.append(Shutdown())
    assert [inbox.next(0), inbox.next(0), inbox.next(0), inbox.next(0)] == [
        AbortRequests(["a"]),
        add("b"),
        Shutdown(),
        None,
    ]


def test_a_step_is_abandoned_only_when_all_its_requests_were_aborted():
    inbox = scripted([AbortRequests(["a"]), add("c")])
    assert not inbox.are_aborted(["a", "b"])
    assert not inbox.are_aborted([])
    inbox._recv = lambda timeout_s: None  # type: ignore[method-assign]
    assert inbox.are_aborted(["a"])  # still known: the abort has not been handled yet


def test_aborts_handled_by_the_loop_are_forgotten():
    inbox = scripted([AbortRequests(["a"])])
    assert inbox.are_aborted(["a"])
    assert inbox.next(0) == AbortRequests(["a"])
    assert inbox.next(0) is None  # the loop drained its inbox: the next step begins
    assert not inbox.are_aborted(["a"])  # a request "a" added again is a new one
