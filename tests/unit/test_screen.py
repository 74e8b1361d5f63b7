"""The server's half of the query of death: what is in flight, what ran at a failure, what was
answered, the quarantine list, the faults one request's prompt triggers."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference import screen as screen_mod
from gpu_watchdog.inference.engine import Engine
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.errors import FatalCudaError
from gpu_watchdog.inference.faults import FaultError, FaultInjector
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.screen import (
    ANSWERED_FOR_S,
    BOOKING,
    MARKED,
    QUARANTINE_MAX,
    REPORTED,
    Entry,
    QuarantinedRequest,
    QuarantineError,
    QuarantineList,
    RequestAccount,
    RequestBook,
    Screen,
    parse_entry,
    prompt_text,
)


def test_the_book_reports_in_flight_newest_first_and_freezes_at_the_failure() -> None:
    book = RequestBook("i1")
    a, b = book.begin("fa", "ia"), book.begin("fb")
    book.begin("fa", "ia")  # the same request twice in flight: reported once
    report = book.report()
    assert report["inflight"] == ["fa", "fb"] and report["inputs"] == ["ia", ""]
    assert report["newest"] == "fa" and report["inflight_total"] == 3
    book.end(a, ok=True)
    assert {"fa", "ia"} <= set(book.report()["completed"])  # the request and its input, both answered
    frozen = book.failed()
    book.end(b, ok=False)
    assert book.report()["at_failure"] == frozen and frozen["inflight"] == ["fa", "fb"]
    assert "fb" not in book.report()["completed"]  # an error is not a completion
    assert book.failed() == frozen  # the first failure wins
    book.end(book.begin("after"), ok=True)  # a stream answered 200 that ends on the lost context
    assert "after" not in book.report()["completed"] and frozen["completed"] == ["fa", "ia"]


def test_only_the_read_that_takes_the_evidence_lets_a_failed_process_go() -> None:
    book = RequestBook("i1")
    book.begin("fa", "ia")
    book.failed()
    book.report()  # what was answered lately, read by the sync: the evidence is not taken
    assert not book.failure_read.is_set()
    assert book.report(evidence=True)["at_failure"]["inflight"] == ["fa"]
    assert book.failure_read.is_set() and book.wait_read()


def test_an_answer_is_kept_for_its_hour_however_many_come_after_it() -> None:
    now = [1000.0]
    book = RequestBook("i1", clock=lambda: now[0])
    book.end(book.begin("innocent", "innocent-input"), ok=True)
    for i in range(5000):  # 50 a second for 100 s: a count of 256 forgot the innocent after 5 s
        now[0] += 0.02
        book.end(book.begin(f"r{i}"), ok=True)
    report = book.report()
    assert {"innocent", "innocent-input"} <= set(report["completed"]) and report["forgot_until"] is None
    # Answered again: its last success is what counts.
    now[0] = 1000.0 + ANSWERED_FOR_S - 1
    book.end(book.begin("innocent", "innocent-input"), ok=True)
    now[0] = 1000.0 + ANSWERED_FOR_S + 200
    report = book.report()
    assert "innocent" in report["completed"] and "r0" not in report["completed"]
    assert report["forgot_until"] == pytest.approx(1000.0 + 5000 * 0.02)  # the newest answer forgotten by age


def test_past_its_bound_the_book_says_until_when_it_forgot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(screen_mod, "ANSWERED_MAX", 4)
    now = [0.0]
    book = RequestBook("i1", clock=lambda: now[0])
    for i in range(6):
        now[0] = float(i)
        book.end(book.begin(f"r{i}"), ok=True)
    report = book.report()
    assert report["completed"] == ["r2", "r3", "r4", "r5"] and report["forgot_until"] == 1.0
    assert book.failed()["forgot_until"] == 1.0  # frozen with the failure: the sidecar reads it there


def test_a_failures_evidence_is_what_ran_in_its_step_not_the_newest_admitted() -> None:
    book = RequestBook("i1")
    killer = book.begin("killer", "killer-input")
    running = [book.begin(f"running{i}") for i in range(3)]
    for i in range(40):  # admitted after it, waiting: never in the step
        book.begin(f"fresh{i}")
    frozen = book.failed(ran=[killer, *running, 10_000])  # a booking already gone is no evidence
    assert frozen["inflight"] == ["running2", "running1", "running0", "killer"]
    assert frozen["inputs"] == ["", "", "", "killer-input"] and frozen["inflight_total"] == 4
    # Without word of what ran (the agent, a failure outside a step): everything in flight, the
    # oldest first kept where there are more than REPORTED, as those are the ones running.
    crowded = RequestBook("i2")
    crowded.begin("killer")
    for i in range(REPORTED + 10):
        crowded.begin(f"fresh{i}")
    everything = crowded.failed()
    assert len(everything["inflight"]) == REPORTED and everything["inflight"][-1] == "killer"
    assert everything["inflight_total"] == REPORTED + 11


def _as(ticket: int, marks: frozenset[str], fn: Callable[[], Any]) -> Any:
    """`fn` in a request's context: its booking and its fault marks, as the HTTP layer sets them."""
    def inside() -> Any:
        BOOKING.set(ticket)
        MARKED.set(marks)
        return fn()
    return contextvars.copy_context().run(inside)


def test_the_engine_tells_the_book_what_ran_in_the_step_that_lost_the_context() -> None:
    """The killer booked first, 40 requests booked after it (the newest 32 were all the record kept),
    three innocents generating: the step the killer joins loses the context, and its evidence is the
    killer and the three that ran beside it."""
    faults = FaultInjector()
    guard = Guard(faults=faults)
    book = guard.screen.book
    engine = Engine(CausalLM(model_mod.load(None, torch.device("cpu"))), guard=guard)
    try:
        faults.inject("context_loss", {"when_prompt_contains": "KILLER"})
        codec = engine.lm.codec
        killer = book.begin("killer", "killer-input")
        innocents = [book.begin(f"innocent{i}") for i in range(3)]
        for i in range(40):
            book.begin(f"fresh{i}")
        errors: list[BaseException] = []

        def generate(ticket: int, text: str, tokens: int) -> None:
            try:
                _as(ticket, faults.marks(text), lambda: engine.generate([GenRequest(codec.encode(text), tokens)]))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=generate, args=(t, f"a long innocent story {t}", 400)) for t in innocents]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.inflight < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.inflight == 3
        generate(killer, "run the KILLER shape", 4)
        for t in threads:
            t.join(30)
        assert len(errors) == 4 and all(isinstance(e, FatalCudaError) for e in errors)
        frozen = book.report()["at_failure"]
        assert sorted(frozen["inflight"]) == ["innocent0", "innocent1", "innocent2", "killer"]
        assert frozen["inputs"][frozen["inflight"].index("killer")] == "killer-input"
        assert frozen["inflight_total"] == 4  # none of the 40 admitted after the killer: they never ran
    finally:
        engine.stop()


def test_every_spelling_and_setting_of_one_input_has_its_input_fingerprint() -> None:
    screen = Screen("i1", "model-a")
    screen.decode = lambda ids: bytes(t for t in ids if 0 <= t < 256).decode("utf-8", "replace")  # the byte codec
    prompt = {"prompt": "the KILLER shape", "max_tokens": 8}
    killer = screen.prints(prompt)
    tries = [{**prompt, "temperature": 0.9}, {**prompt, "seed": 7}, {**prompt, "top_p": 0.5},
             {**prompt, "max_tokens": 9}, {**prompt, "stop": ["never matches"]}, {**prompt, "presence_penalty": 1e-9},
             {**prompt, "n": 2}, {"prompt": list(b"the KILLER shape"), "max_tokens": 8},
             {"prompt": [257, *b"the KILLER shape"]}, {"messages": [{"role": "user", "content": "the KILLER shape"}]},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "the KILLER "},
                                                       {"type": "text", "text": "shape"}]}], "seed": 3}]
    prints = [screen.prints(body) for body in tries]
    assert len({fp for fp, _ in [killer, *prints]}) == len(tries) + 1  # as many fingerprints as tries
    assert {i for _, i in prints} == {killer[1]} and killer[1] is not None and killer[1] != killer[0]
    assert screen.prints({"prompt": "another shape"})[1] != killer[1]
    assert screen.prints({"instances": [1]})[1] is None  # an app's own body: its fingerprint stands for it


def test_a_quarantined_input_is_refused_whatever_its_settings_and_an_exact_entry_only_itself() -> None:
    screen = Screen("i1", "model-a")
    body = {"prompt": "the KILLER shape", "max_tokens": 8}
    fp, input_fp = screen.prints(body)
    assert fp is not None and input_fp is not None
    screen.quarantine.add(Entry(fp, until=9e12, failures=2))
    with pytest.raises(QuarantinedRequest) as refused:
        screen.request(RequestAccount(), body)
    assert not refused.value.by_input and refused.value.body()["error"]["message"].startswith("this request was")
    screen.request(RequestAccount(), {**body, "temperature": 0.9})  # its twin: served
    screen.quarantine.add(Entry(input_fp, until=9e12, failures=3))
    for other in ({**body, "temperature": 0.9}, {"messages": [{"role": "user", "content": "the KILLER shape"}]}):
        account = RequestAccount()
        with pytest.raises(QuarantinedRequest) as refused:
            screen.request(account, other)
        error = refused.value.body()["error"]
        assert refused.value.status == 422 and error["fingerprint"] == input_fp
        assert error["message"].startswith("this request's input") and "in flight at 3 failures" in error["message"]
        assert account.input_fingerprint == input_fp and account.ticket is None
    screen.request(RequestAccount(), {"prompt": "another shape"})  # nothing else is refused


def test_the_list_refuses_until_its_time_and_stays_bounded() -> None:
    now = [1000.0]
    q = QuarantineList(clock=lambda: now[0])
    q.add(Entry("ab", until=1010.0, failures=2, pods=("p1", "p2")))
    assert q.lookup("ab") is not None and q.lookup("cd") is None
    now[0] = 1010.0
    assert q.lookup("ab") is None and q.describe() == []
    q.replace([Entry(f"{i:x}", until=2000.0 + i) for i in range(QUARANTINE_MAX + 3)])
    assert len(q.describe()) == QUARANTINE_MAX and q.lookup("0") is None  # the soonest to end went first
    assert q.lift(f"{QUARANTINE_MAX:x}") and not q.lift("nope")


def test_an_entry_names_its_bad_field() -> None:
    assert parse_entry({"fingerprint": "0a1b", "until": 5, "pods": ["x"]}) == Entry("0a1b", 5.0, 0, ("x",))
    for body, field in (({"until": 1}, "fingerprint"), ({"fingerprint": "XYZ", "until": 1}, "fingerprint"),
                        ({"fingerprint": "ab"}, "until"), ({"fingerprint": "ab", "until": True}, "until"),
                        ({"fingerprint": "ab", "until": 1, "failures": -1}, "failures"),
                        ({"fingerprint": "ab", "until": 1, "pods": "p"}, "pods")):
        with pytest.raises(QuarantineError) as err:
            parse_entry(body, "entries[3].")
        assert err.value.param == f"entries[3].{field}"
    for until in (float("inf"), float("nan"), 1e300, -1):
        with pytest.raises(QuarantineError):
            parse_entry({"fingerprint": "ab", "until": until})


def test_a_screen_refuses_what_is_listed_counts_it_and_books_the_rest() -> None:
    screen = Screen("i1", "model-a")
    counted: list[int] = []
    screen.on_refused = lambda: counted.append(1)
    account = RequestAccount()
    body = {"prompt": "hello", "max_tokens": 3}
    screen.request(account, body)
    fp = account.fingerprint
    assert isinstance(fp, str) and screen.book.report()["inflight"] == [fp]
    screen.done(account.ticket, ok=True)
    screen.quarantine.add(Entry(fp, until=9e12, failures=2))
    with pytest.raises(QuarantinedRequest) as refused:
        # The same computation spelt otherwise: the model named, fields at their defaults, another user.
        screen.request(RequestAccount(), {**body, "model": "model-a", "n": 1, "stop": None, "user": "u2"})
    assert refused.value.status == 422 and refused.value.body()["error"]["fingerprint"] == fp
    assert counted == [1] and screen.book.report()["inflight"] == []
    screen.request(RequestAccount(), {**body, "max_tokens": 4})  # other work: admitted
    screen.request(RequestAccount(), {**body, "temperature": 1.5})  # another sampler: another computation
    # The same body fingerprints alike on another replica of the same model, not of another model.
    other = Screen("i2", "model-a")
    assert other.of_body(body) == fp and Screen("i3", "model-b").of_body(body) != fp
    assert other.of_raw(b'{"max_tokens": 3, "prompt": "hello"}') == fp and other.of_raw(b"  ") is None
    assert other.of_raw(b"raw bytes", describe=lambda raw: None) is None
    # Whatever a client sends costs at most its fingerprint: a lone surrogate, nesting past the parser.
    assert other.of_body({"prompt": "\ud800"}) is not None
    assert other.of_raw(b"[" * 100_000 + b"]" * 100_000) is None
    assert other.of_raw(b"{}", describe=lambda raw: 1 / 0) is None
    # An app's own JSON without the usual fields: its fields are the work, not one shared fingerprint.
    assert other.of_body({"instances": [1]}) != other.of_body({"instances": [2]})
    assert other.of_body({"instances": [1], "user": "a"}) == other.of_body({"instances": [1], "user": "b"})


def test_a_fault_for_a_prompt_fires_only_for_it_every_time_until_cleared() -> None:
    faults = FaultInjector()
    with pytest.raises(FaultError, match="when_prompt_contains"):
        faults.inject("fragmentation", {"when_prompt_contains": "x"})
    with pytest.raises(FaultError, match="when_prompt_contains"):
        faults.inject("context_loss", {"when_prompt_contains": ""})
    faults.inject("context_loss", {"when_prompt_contains": "BOOM"})
    assert faults.describe()["context_loss"] is False  # nothing else is touched
    text = prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a BOOM b"}]}]})
    marks = faults.marks(text)
    assert marks == {"context_loss"} and faults.marks("calm") == frozenset()
    faults.before_forward(1)  # unmarked work runs
    for _ in range(2):
        with pytest.raises(FatalCudaError):
            faults.before_forward(1, marks)
    with pytest.raises(FatalCudaError):
        faults.during_forward(2, marks)
    faults.inject("clear", {})
    faults.before_forward(1, marks)
    assert faults.marks(text) == frozenset()
