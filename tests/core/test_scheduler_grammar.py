"""Constrained requests in the scheduler: a compiling constraint delays its own request only,
a complete output finishes it with "stop", and a failed compile ends it with "abort"."""

from __future__ import annotations

from pagedllm.core.request import RequestStatus
from tests.core.helpers import Run, make_request, make_scheduler, runner_for, step


class FakeGrammar:
    """Stands in for ``RequestGrammar``: ready when told, done after ``length`` tokens."""

    def __init__(self, length: int = 100, ready: bool = False, error: str | None = None) -> None:
        self._ready, self.error, self.length = ready, error, length
        self.accepted: list[int] = []

    @property
    def ready(self) -> bool:
        return self._ready

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def constrained(request_id: str, grammar: FakeGrammar, **kwargs):
    request = make_request(request_id, 5, **kwargs)
    request.grammar = grammar
    return request


def test_a_compiling_request_waits_without_blocking_later_ones():
    scheduler = make_scheduler()
    grammar = FakeGrammar()
    scheduler.add_request(constrained("slow", grammar, max_tokens=3))
    scheduler.add_request(make_request("free", 5, max_tokens=3))
    assert scheduler.num_waiting == 2 and scheduler.num_waiting_for_grammar == 1
    runner, run = runner_for(scheduler), Run()
    so = step(scheduler, runner, run)
    assert set(so.num_scheduled_tokens) == {"free"}
    assert scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    grammar._ready = True
    so = step(scheduler, runner, run)
    assert "slow" in so.num_scheduled_tokens and scheduler.num_waiting_for_grammar == 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, run)
    assert run.finish_reasons == {"slow": "length", "free": "length"}
    assert grammar.accepted == run.outputs["slow"]  # every output token, in order


def test_a_complete_output_finishes_with_stop():
    scheduler = make_scheduler()
    scheduler.add_request(constrained("r", FakeGrammar(length=2, ready=True), max_tokens=10))
    runner, run = runner_for(scheduler), Run()
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, run)
    assert run.finish_reasons == {"r": "stop"} and len(run.outputs["r"]) == 2


def test_a_failed_compile_finishes_with_abort_and_its_message():
    scheduler = make_scheduler()
    scheduler.add_request(constrained("bad", FakeGrammar()))
    scheduler.requests["bad"].grammar._ready = True
    scheduler.requests["bad"].grammar.error = "cannot compile"
    assert scheduler.schedule().is_empty
    outputs = scheduler.take_unstepped_outputs()
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outputs] == [
        ("bad", "abort", "cannot compile")]
    assert not scheduler.has_unfinished_requests() and scheduler.take_unstepped_outputs() == []


def test_aborting_a_compiling_request_forgets_it():
    scheduler = make_scheduler()
    scheduler.add_request(constrained("r", FakeGrammar()))
    scheduler.abort_requests(["r"])
    assert not scheduler.has_unfinished_requests() and scheduler.num_waiting == 0
    assert scheduler.schedule().finished_req_ids == {"r"}
