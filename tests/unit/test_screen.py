"""The server's half of the query of death: what is in flight, the quarantine list, the faults one
request's prompt triggers."""

from __future__ import annotations

import pytest

from gpu_watchdog.inference.errors import FatalCudaError
from gpu_watchdog.inference.faults import FaultError, FaultInjector
from gpu_watchdog.inference.screen import (
    COMPLETED_KEPT,
    QUARANTINE_MAX,
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
    a, b = book.begin("fa"), book.begin("fb")
    book.begin("fa")  # the same request twice in flight: reported once
    report = book.report()
    assert report["inflight"] == ["fa", "fb"] and report["newest"] == "fa" and report["inflight_total"] == 3
    book.end(a, ok=True)
    assert "fa" in book.report()["completed"]
    frozen = book.failed()
    book.end(b, ok=False)
    assert book.report()["at_failure"] == frozen and frozen["inflight"] == ["fa", "fb"]
    assert "fb" not in book.report()["completed"]  # an error is not a completion
    assert book.failed() == frozen  # the first failure wins
    book.end(book.begin("after"), ok=True)  # a stream answered 200 that ends on the lost context
    assert "after" not in book.report()["completed"] and frozen["completed"] == ["fa"]
    fresh = RequestBook("i2")
    for i in range(COMPLETED_KEPT + 5):
        fresh.end(fresh.begin(f"c{i}"), ok=True)
    fresh.end(fresh.begin("c0"), ok=True)  # again: now among the most recent
    assert len(fresh.report()["completed"]) == COMPLETED_KEPT and fresh.report()["completed"][-1] == "c0"


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
