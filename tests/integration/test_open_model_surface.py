"""What open-model clients send beyond OpenAI's basics (vLLM's extra sampling parameters, n, logprobs,
echo, /tokenize), through the official `openai` SDK where it applies, against the built-in model."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests

from tests.helpers import Server, start_server

NAME = "tiny-open"
BOT = 257  # the built-in model's beginning-of-text id; other ids are bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("open"), "--served-model-name", NAME, "--max-concurrency", "16")
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, prompt: str, tokens: int = 12, **extra: Any) -> Any:
    known = {k: extra.pop(k) for k in ("temperature", "seed", "stop", "logprobs", "echo", "n", "top_p",
                                       "presence_penalty", "frequency_penalty", "logit_bias") if k in extra}
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens, extra_body=extra or None, **known)


def test_sampling_knobs_that_keep_only_the_best_token_give_the_greedy_answer(client: openai.OpenAI) -> None:
    greedy = complete(client, "knobs").choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": 1, "top_p": 0.5, "min_p": 0.2}):
        sampled = complete(client, "knobs", temperature=1.5, seed=9, **extra).choices[0].text
        assert sampled == greedy, extra
    # Neutral values change nothing (vLLM's benchmark client always sends these).
    same = complete(client, "knobs", repetition_penalty=1.0, ignore_eos=True, top_k=-1, min_p=0.0,
                    presence_penalty=0.0, skip_special_tokens=True)
    assert same.choices[0].text == greedy


def test_logit_bias_and_penalties_steer_the_answer(client: openai.OpenAI) -> None:
    z = ord("Z")
    assert complete(client, "bias", logit_bias={str(z): 100}).choices[0].text == "Z" * 12
    best = complete(client, "bias", tokens=1).choices[0].text
    avoided = complete(client, "bias", tokens=1, logit_bias={str(ord(best)): -100}).choices[0].text
    assert avoided != best
    # Reported log-probabilities are the model's own (before bias and penalties), so every greedy
    # choice can be checked: it is the best of the raw scores after bias and the output penalties.
    knobs = {"logit_bias": {str(z): 3.0}, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    steered = complete(client, "bias", tokens=16, logprobs=20, **knobs).choices[0]
    assert steered.text != complete(client, "bias", tokens=16).choices[0].text
    assert steered.logprobs is not None and steered.logprobs.top_logprobs is not None
    counts: dict[str, int] = {}
    for token, top in zip(steered.logprobs.tokens or [], steered.logprobs.top_logprobs, strict=True):
        assert top is not None
        scores = {t: v + (3.0 if t == "Z" else 0.0) - 1.5 * counts.get(t, 0) - (0.5 if counts.get(t, 0) else 0.0)
                  for t, v in top.items()}
        assert max(scores, key=lambda t: scores[t]) == token, (token, top)
        counts[token] = counts.get(token, 0) + 1


def test_stop_token_ids_min_tokens_and_stop_strings_in_the_output(client: openai.OpenAI) -> None:
    full = complete(client, "stops", tokens=30).choices[0].text
    third = full[2]
    cut = complete(client, "stops", tokens=30, stop_token_ids=[ord(third)])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(third)]
    held = complete(client, "stops", tokens=30, stop_token_ids=[ord(full[0])], min_tokens=5)
    assert held.usage is not None and held.usage.completion_tokens >= 5
    assert full[0] not in held.choices[0].text[:5]
    stop = full[8:10]
    kept = complete(client, "stops", tokens=30, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == full[: full.index(stop)] + stop


def test_n_choices_are_batched_seeded_apart_and_greedy_equal(server: Server, client: openai.OpenAI) -> None:
    solo = complete(client, "many", tokens=10).choices[0].text
    r = complete(client, "many", tokens=10, n=3)
    assert [(c.index, c.text) for c in r.choices] == [(0, solo), (1, solo), (2, solo)]
    assert r.usage is not None and r.usage.prompt_tokens == len("many") + 1 and r.usage.completion_tokens == 30
    both = client.completions.create(model=NAME, prompt=["many", "other"], max_tokens=10, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == solo
    sampled = complete(client, "many", tokens=16, temperature=1.0, seed=11, n=4)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1
    again = complete(client, "many", tokens=16, temperature=1.0, seed=11, n=4)
    assert [c.text for c in again.choices] == texts
    # Choice 0 draws from the request's seed, as a single answer with that seed does.
    assert complete(client, "many", tokens=16, temperature=1.0, seed=11).choices[0].text == texts[0]


def test_completion_logprobs_are_consistent_with_scoring_the_echoed_text(client: openai.OpenAI) -> None:
    r = complete(client, "score", tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == text and len(lp.tokens) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0
        assert top[token] == value and 3 <= len(top) <= 4
        assert value == max(top.values())  # greedy: the chosen token is the most likely one
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    # Scoring prompt + answer (echo, one more token) gives back the answer's log-probabilities.
    scored = client.completions.create(model=NAME, prompt=[BOT, *(ord(c) for c in "score" + text)], max_tokens=1,
                                       logprobs=1, echo=True)
    s = scored.choices[0]
    assert s.text.startswith("score" + text)
    assert s.logprobs is not None and s.logprobs.token_logprobs is not None and s.logprobs.tokens is not None
    assert s.logprobs.token_logprobs[0] is None and s.logprobs.top_logprobs is not None
    assert s.logprobs.top_logprobs[0] is None
    assert len(s.logprobs.tokens) == 1 + len("score") + 8 + 1
    tail = s.logprobs.token_logprobs[1 + len("score"): 1 + len("score") + 8]
    assert all(a is not None and abs(a - b) < 1e-4 for a, b in zip(tail, lp.token_logprobs, strict=True))
    # Echo without logprobs: the prompt's text, then the answer.
    echoed = complete(client, "score", tokens=8, echo=True).choices[0]
    assert echoed.text == "score" + text and echoed.logprobs is None


def test_streamed_logprobs_match_the_whole_answer(client: openai.OpenAI) -> None:
    whole = complete(client, "flow", tokens=10, logprobs=2, echo=True).choices[0]
    chunks = list(client.completions.create(model=NAME, prompt="flow", max_tokens=10, logprobs=2, echo=True,
                                            stream=True))
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            lp = c.choices[0].logprobs
            tokens += lp.tokens or []
            values += lp.token_logprobs or []
            offsets += lp.text_offset or []
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert whole.logprobs is not None
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert whole.logprobs.token_logprobs is not None
    assert all((a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-4)
               for a, b in zip(values, whole.logprobs.token_logprobs, strict=True))


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "rate me"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.bytes == list(item.token.encode())
    streamed = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, logprobs=True,
                                                   top_logprobs=2, stream=True))
    items = [i for c in streamed if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
             for i in c.choices[0].logprobs.content]
    assert [i.token for i in items] == [i.token for i in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(items, content, strict=True))
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert all(i.top_logprobs == [] for i in plain.choices[0].logprobs.content)


def test_tokenize_and_detokenize_in_vllms_shape(server: Server) -> None:
    r = requests.post(server.url + "/tokenize", json={"model": NAME, "prompt": "Hi!", "return_token_strs": True},
                      timeout=10).json()
    assert r == {"count": 4, "max_model_len": 1024, "tokens": [BOT, 72, 105, 33], "token_strs": ["", "H", "i", "!"]}
    bare = requests.post(server.url + "/tokenize", json={"prompt": "Hi!", "add_special_tokens": False}, timeout=10)
    assert bare.json()["tokens"] == [72, 105, 33] and bare.json()["token_strs"] is None
    chat = requests.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                         timeout=10).json()
    assert chat["tokens"] == [BOT, *b"user: Hi\nassistant: "]
    back = requests.post(server.url + "/detokenize", json={"tokens": [72, 105, 33]}, timeout=10)
    assert back.json() == {"prompt": "Hi!"}
    cases: list[tuple[str, Any, str]] = [("/detokenize", {"tokens": [72, 99999]}, "tokens[1]"),
                                         ("/detokenize", {"tokens": "Hi"}, "tokens"),
                                         ("/tokenize", {"prompt": 5}, "prompt"),
                                         ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
                                         ("/tokenize", {"prompt": "x", "shout": True}, "shout")]
    for path, body, field in cases:
        bad = requests.post(server.url + path, json=body, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (path, body)
    assert requests.post(server.url + "/tokenize", json={"model": "other", "prompt": "x"}, timeout=10
                         ).status_code == 404


@pytest.mark.parametrize(("body", "field"), [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"min_tokens": 50}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"stop_token_ids": [99999]}, "stop_token_ids[0]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"), ({"logit_bias": {"65": 101}}, "logit_bias.65"),
    ({"logprobs": 21}, "logprobs"), ({"echo": 1}, "echo"), ({"n": 17}, "n"), ({"best_of": 3}, "best_of"),
    ({"suffix": "tail"}, "suffix"), ({"guided_regex": "a+"}, "guided_regex"),
])
def test_bad_or_unsupported_values_name_the_field(server: Server, body: dict[str, Any], field: str) -> None:
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_greedy_rows_answer_as_alone_next_to_rows_with_extras(client: openai.OpenAI) -> None:
    prompts = [f"batch {i}" for i in range(6)]
    solo = [complete(client, p, tokens=20).choices[0].text for p in prompts]

    def busy(i: int) -> Any:
        if i % 2:
            return complete(client, prompts[i // 2], tokens=20).choices[0].text
        return complete(client, f"noise {i}", tokens=20, temperature=1.0, top_k=5, repetition_penalty=1.3,
                        logprobs=2, echo=True, n=2)

    with ThreadPoolExecutor(12) as pool:
        out = list(pool.map(busy, range(12)))
    assert [out[i] for i in range(1, 12, 2)] == solo
