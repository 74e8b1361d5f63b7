"""Fingerprints: one computation, one fingerprint on any replica, however it is spelt; never the text."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
from typing import Any

from gpu_watchdog.inference.fingerprint import fingerprint, input_fingerprint
from gpu_watchdog.inference.screen import Screen

KEY = b"workload-key"
BASE = {"prompt": "boom", "max_tokens": 8}
# Ten fields at the value the server takes when they are absent.
AT_DEFAULT: dict[str, Any] = {"model": "m", "n": 1, "stop": None, "echo": False, "logprobs": None, "best_of": 1,
                              "temperature": 0, "top_p": 1.0, "logit_bias": {}, "stop_token_ids": []}
# Each of the sampler's parameters (and the rest of what changes the work) away from its default.
CHANGES: list[dict[str, Any]] = [
    {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 7}, {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"logit_bias": {"5": 10}}, {"min_tokens": 2},
    {"ignore_eos": True}, {"stop_token_ids": [3]}, {"skip_special_tokens": False},
    {"include_stop_str_in_output": True}, {"max_tokens": 9}, {"n": 2}, {"stop": "."}, {"logprobs": 1},
    {"echo": True}, {"prompt": "boom!"}, {"suffix": "tail"}, {"response_format": {"type": "json_object"}},
]


def fp(body: Any, **kw: Any) -> str:
    return fingerprint(KEY, body, **kw)


def test_every_spelling_of_one_computation_is_one_fingerprint() -> None:
    prints = set()
    for present in itertools.product((False, True), repeat=len(AT_DEFAULT)):
        extra = {k: v for (k, v), on in zip(AT_DEFAULT.items(), present, strict=True) if on}
        prints.add(fp({**BASE, **extra}))
    assert len(prints) == 1 and prints == {fp(BASE)}
    assert len(fp(BASE)) == 16 and "boom" not in fp(BASE)
    assert fingerprint(b"another-key", BASE) != fp(BASE)


def test_each_parameter_that_changes_the_work_changes_the_fingerprint() -> None:
    prints = {fp({**BASE, **change}) for change in CHANGES}
    assert len(prints) == len(CHANGES) and fp(BASE) not in prints


def test_a_hostile_sampler_setting_does_not_hide_behind_its_benign_twin() -> None:
    hostile = {**BASE, "logit_bias": {str(t): 100 for t in range(300)}, "temperature": 2.0}
    assert fp(hostile) != fp(BASE)
    assert fp(hostile) != fp({**BASE, "logit_bias": {str(t): 100 for t in range(299)}, "temperature": 2.0})
    # Quarantining the hostile one leaves the benign one served.
    screen = Screen("i", "m")
    assert screen.of_body(hostile) != screen.of_body(BASE)


def test_values_the_server_reads_alike_are_alike() -> None:
    assert fp({**BASE, "temperature": 1}) == fp({**BASE, "temperature": 1.0})
    assert fp({**BASE, "logit_bias": {"5": 1}}) == fp({**BASE, "logit_bias": {"5": 1.0}})
    assert fp({**BASE, "stop": "x"}) == fp({**BASE, "stop": ["x"]})
    assert fp({**BASE, "stop": ["x", "y"]}) == fp({**BASE, "stop": ["y", "x", "y"]})
    assert fp({**BASE, "logit_bias": {"5": 1, "7": -2}}) == fp({**BASE, "logit_bias": {"7": -2.0, "5": 1}})
    assert fp({**BASE, "stop_token_ids": [3, 1]}) == fp({**BASE, "stop_token_ids": [1, 3, 3]})
    assert fp({**BASE, "top_k": -1}) == fp({**BASE, "top_k": 0}) == fp(BASE)  # both: every token
    assert fp({**BASE, "stop": []}) == fp({**BASE, "tools": []}) == fp({**BASE, "tool_choice": "none"}) == fp(BASE)
    assert fp({**BASE, "max_tokens": None}) == fp({"prompt": "boom"}) != fp(BASE)
    # A lone prompt is a list of one: a string, or a list of token ids.
    assert fp({**BASE, "prompt": ["boom"]}) == fp(BASE)
    assert fp({**BASE, "prompt": [1, 2]}) == fp({**BASE, "prompt": [[1, 2]]}) != fp({**BASE, "prompt": [[1], [2]]})


def test_the_model_and_how_the_answer_is_sent_do_not_count() -> None:
    assert fp({**BASE, "model": "a"}) == fp({**BASE, "model": "b"}) == fp(BASE)
    assert fp({**BASE, "user": "alice", "stream": True, "stream_options": {"include_usage": True}}) == fp(
        {**BASE, "user": "bob", "stream": False})
    assert fp({**BASE, "metadata": {"team": "x"}, "store": False, "parallel_tool_calls": True}) == fp(BASE)


def test_chat_spellings_of_one_conversation_agree() -> None:
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
    assert fp(chat) == fp({"messages": [{"role": "user", "name": "ann", "content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}], "max_completion_tokens": 5,
        "logprobs": False, "top_logprobs": 0, "model": "m", "n": 1})
    assert fp({**chat, "logprobs": True}) == fp({**chat, "logprobs": True, "top_logprobs": 0}) != fp(chat)
    assert fp({**chat, "logprobs": True, "top_logprobs": 2}) != fp({**chat, "logprobs": True})
    assert fp({**chat, "messages": [{"role": "system", "content": "hello there"}]}) != fp(chat)
    assert fp({**chat, "seed": 1}) != fp(chat) and fp({**chat, "temperature": 0.5}) != fp(chat)


def test_embeddings_inputs_count_and_how_vectors_are_written_does_not() -> None:
    body = {"input": "a sentence", "model": "e"}
    assert fp(body) == fp({"input": ["a sentence"], "encoding_format": "base64", "dimensions": 256, "user": "u"})
    assert fp({"input": [5, 6]}) == fp({"input": [[5, 6]]}) != fp(body)
    assert fp({"input": ["a", "b"]}) != fp({"input": ["b", "a"]})


def test_tokens_stand_for_the_text() -> None:
    assert fp({"prompt": "a b"}, tokens=[1, 2]) == fp({"prompt": "a  b"}, tokens=[1, 2])
    assert fp({"prompt": "a b", "temperature": 1}, tokens=[1, 2]) != fp({"prompt": "a b"}, tokens=[1, 2])
    assert fp({"messages": [{"role": "user", "content": "x"}]}, tokens=[1]) == fp({"prompt": "y"}, tokens=[1])


def test_a_body_the_server_refuses_still_has_one_fingerprint() -> None:
    bad = {**BASE, "temperature": "hot"}
    assert fp(bad) == fp(dict(bad)) != fp(BASE)
    assert fp({"messages": "not a list"}) != fp({"messages": "another"})


def _app_rule(body: Any) -> str:
    """The rule for an app's own body: all of it but what never changes the work, sorted keys, no spaces."""
    work = {k: v for k, v in body.items() if k not in {"user", "stream", "request_id", "id", "metadata",
                                                       "timeout", "stream_options"}} if isinstance(body, dict) \
        else body
    text = json.dumps(work, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(KEY, text.encode(), hashlib.sha256).hexdigest()[:16]


def test_an_apps_own_body_counts_whole_but_for_what_never_changes_the_work() -> None:
    for body in ({"instances": [1], "user": "a"}, {"instances": [1.0], "request_id": "r1"}, ["an", "own", "body"],
                 "text", {"inputs": "fine", "max_new_tokens": 2}):
        assert fp(body) == _app_rule(body)
    assert fp({"instances": [1], "user": "a"}) == fp({"instances": [1], "user": "b"})
    assert fp({"instances": [1]}) != fp({"instances": [2]}) and fp(["an"]) != fp(["another"])
    # Its own knobs count: an app's sampler settings are its work too.
    assert fp({"inputs": "fine", "max_new_tokens": 2}) != fp({"inputs": "fine", "max_new_tokens": 3})
    assert fp({"inputs": "fine", "temperature": 1}) != fp({"inputs": "fine", "temperature": 0})


def test_what_the_apps_function_describes_counts_whole() -> None:
    screen = Screen("i", "m")
    describe = json.loads
    assert screen.of_raw(b'{"prompt": "p", "max_new_tokens": 8}', describe) != screen.of_raw(
        b'{"prompt": "p", "max_new_tokens": 9}', describe)
    assert screen.of_raw(b'{"b": 1, "a": 2}', describe) == screen.of_raw(b'{"a": 2, "b": 1}', describe)


def ifp(body: Any, decode: Any = None) -> str | None:
    return input_fingerprint(KEY, body, decode)


def _bytes(ids: list[int]) -> str:
    return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", "replace")


def test_the_input_fingerprint_is_the_input_alone_whatever_the_settings() -> None:
    for change in CHANGES:
        if "prompt" not in change and "suffix" not in change:
            assert ifp({**BASE, **change}) == ifp(BASE), change
    assert ifp({**BASE, "prompt": "boom!"}) != ifp(BASE)
    # Not the exact fingerprint, nor any body's: keyed apart.
    assert ifp(BASE) != fp(BASE) and ifp(BASE) != fp({"input": ["boom"]}) and len(ifp(BASE) or "") == 16
    assert input_fingerprint(b"another-key", BASE) != ifp(BASE)


def test_every_spelling_of_one_input_is_one_input_fingerprint() -> None:
    text = ifp(BASE)
    assert ifp({"prompt": ["boom"]}) == ifp({"messages": [{"role": "user", "content": "boom"}]}) == text
    assert ifp({"messages": [{"role": "system", "content": [{"type": "text", "text": "bo"},
                                                              {"type": "text", "text": "om"}]}]}) == text
    assert ifp({"input": "boom"}) == text
    # Token ids are the text they read as, through the model's tokenizer (special tokens left out).
    assert ifp({"prompt": list(b"boom")}, _bytes) == ifp({"prompt": [257, *b"boom"]}, _bytes) == text
    assert ifp({"prompt": list(b"boom")}) != text  # no tokenizer: ids as sent

    def broken(ids: list[int]) -> str:
        raise OverflowError("out of range")

    assert ifp({"prompt": [2**70]}, broken) == ifp({"prompt": [2**70]})  # unreadable ids: as sent
    # Several prompts or messages: each in order.
    assert ifp({"prompt": ["a", "b"]}) == ifp({"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "b"}]})
    assert ifp({"prompt": ["a", "b"]}) != ifp({"prompt": ["b", "a"]}) != ifp({"prompt": "ab"})


def test_a_body_without_an_openai_input_has_no_input_fingerprint() -> None:
    for body in ({"instances": [1]}, ["an", "own", "body"], "text", None):
        assert ifp(body) is None
    # A refused shape still has one, as sent.
    assert ifp({"messages": "not a list"}) != ifp({"messages": "another"})
    assert ifp({"prompt": 5}) != ifp({"prompt": 6})
