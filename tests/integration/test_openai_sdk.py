"""The official `openai` SDK as the client of the bundled server: the calls applications make first."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from tests.helpers import Server, start_server
from tests.integration.workers import start_tree, worker_requests

NAME = "tiny-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("sdk"), "--served-model-name", NAME, "--max-concurrency", "8")
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("some-other-model")


def test_completion_echoes_the_model_and_counts_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model=NAME, prompt="The GPU said", max_tokens=12)
    assert r.model == NAME
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text) == 12
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len("The GPU said") + 1


def test_a_list_of_prompts_and_token_ids_answer_one_choice_each(client: openai.OpenAI) -> None:
    one = client.completions.create(model=NAME, prompt="alpha", max_tokens=6).choices[0].text
    two = client.completions.create(model=NAME, prompt="beta", max_tokens=6).choices[0].text
    both = client.completions.create(model=NAME, prompt=["alpha", "beta"], max_tokens=6)
    assert [(c.index, c.text) for c in both.choices] == [(0, one), (1, two)]
    # The built-in model's tokens are bytes after a beginning-of-text id (257).
    ids = [257, *b"alpha"]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == one
    several = client.completions.create(model=NAME, prompt=[ids, [257, *b"beta"]], max_tokens=6)
    assert [c.text for c in several.choices] == [one, two]


def test_streamed_completion_matches_the_plain_one_and_reports_usage(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=NAME, prompt="stream me", max_tokens=20).choices[0].text
    chunks = list(client.completions.create(model=NAME, prompt="stream me", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 20
    assert all(c.model == NAME for c in chunks)


def test_chat_goes_through_the_template_and_streams_the_same_answer(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=15)
    answer = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert answer is not None and len(answer) == 15
    assert r.usage is not None
    # The built-in template: "role: content" lines, then the assistant's turn.
    assert r.usage.prompt_tokens == len("system: You are terse.\nuser: Hello there\nassistant: ") + 1
    same = client.completions.create(model=NAME, prompt="system: You are terse.\nuser: Hello there\nassistant: ",
                                     max_tokens=15)
    assert same.choices[0].text == answer
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=15, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [15]


def test_stop_seed_top_p_and_user_are_honoured(client: openai.OpenAI) -> None:
    full = client.completions.create(model=NAME, prompt="stop here", max_tokens=30).choices[0].text
    stop = full[8:10]
    cut = client.completions.create(model=NAME, prompt="stop here", max_tokens=30, stop=[stop], user="tester")
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    a = client.completions.create(model=NAME, prompt="dice", max_tokens=16, temperature=1.0, top_p=0.9, seed=5)
    b = client.completions.create(model=NAME, prompt="dice", max_tokens=16, temperature=1.0, top_p=0.9, seed=5)
    c = client.completions.create(model=NAME, prompt="dice", max_tokens=16, temperature=1.0, top_p=0.9, seed=6)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text


def test_unsupported_requests_name_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, best_of=2)
    assert exc.value.body["param"] == "best_of"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"guided_json": {}})
    assert exc.value.body["param"] == "guided_json"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt=[257, 99999], max_tokens=2)
    assert exc.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
    # Neutral values of fields frameworks send routinely are fine.
    ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        presence_penalty=0, frequency_penalty=0, n=1)
    assert ok.choices[0].finish_reason == "length"


def test_streams_are_batched_with_each_other(server: Server, client: openai.OpenAI) -> None:
    before = requests.get(server.control + "/control/memory", headers=server.auth(), timeout=10).json()["engine"]

    def stream(i: int) -> str:
        chunks = client.completions.create(model=NAME, prompt=f"stream {i}", max_tokens=60, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(stream, range(6)))
    after = requests.get(server.control + "/control/memory", headers=server.auth(), timeout=10).json()["engine"]
    assert [len(t) for t in texts] == [60] * 6
    # Six streams of 60 tokens, one after another, would take 360 forward passes.
    assert after["forward_batches"] - before["forward_batches"] < 200
    assert after["largest_batch"] >= 2


def test_a_local_model_directory_chats_through_its_own_template(tmp_path: Path) -> None:
    from gpu_watchdog.benchmarks.make_model import make

    model = make(tmp_path / "m", hidden=64, layers=2, heads=2, vocab=512, context=256, seed=0)
    srv = start_server(tmp_path, "--model", str(model))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["m"]
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        # The template renders "user: hi\nassistant: "; the answer is tokens after it.
        assert r.usage is not None and r.usage.prompt_tokens == len("user: hi\nassistant: ")
        plain = c.completions.create(model="m", prompt="user: hi\nassistant: ", max_tokens=5)
        assert r.choices[0].message.content == plain.choices[0].text
    finally:
        srv.proc.stop()


def test_a_repeated_beginning_is_reported_as_cached_tokens_and_answers_the_same(server: Server,
                                                                                 client: openai.OpenAI) -> None:
    system = {"role": "system", "content": "You answer in one short line, and never more than that. " * 2}
    first = client.chat.completions.create(model=NAME, messages=[system, {"role": "user", "content": "Hi"}],
                                           max_tokens=8)
    again = client.chat.completions.create(model=NAME, messages=[system, {"role": "user", "content": "Hi"}],
                                           max_tokens=8)
    other = client.chat.completions.create(model=NAME, messages=[system, {"role": "user", "content": "Bye"}],
                                           max_tokens=8)
    assert first.usage is not None and again.usage is not None and other.usage is not None
    assert again.choices[0].message.content == first.choices[0].message.content
    details = [u.prompt_tokens_details for u in (first.usage, again.usage, other.usage)]
    assert all(d is not None for d in details)
    cached = [d.cached_tokens for d in details if d is not None]
    # The system prompt and the template around it (well over 100 tokens) came from the cache the
    # second and third time: whole 16-token blocks, the last token always computed.
    assert cached[0] == 0
    assert cached[1] == (again.usage.prompt_tokens - 1) // 16 * 16
    assert 100 <= cached[2] < other.usage.prompt_tokens
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    hits = [line for line in metrics.splitlines() if line.startswith("gpu_inference_prefix_cache_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) >= cached[1] + cached[2]


def test_the_same_calls_through_serve_workers_answer_the_same(client: openai.OpenAI, tmp_path: Path) -> None:
    """`serve --workers 2` behind one port, as the SDK sees it: the same models, the same answers
    plain, streamed and chatted whichever worker takes them, the same errors naming the field."""
    tree = start_tree(tmp_path, 2, "--served-model-name", NAME, "--max-concurrency", "4")
    try:
        sdk = openai.OpenAI(base_url=tree.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in sdk.models.list().data] == [NAME]
        prompts = [f"worker prompt {i}" for i in range(16)]

        def texts(c: openai.OpenAI) -> list[str]:
            with ThreadPoolExecutor(8) as pool:  # at once: the front spreads them over the workers
                return list(pool.map(lambda p: c.completions.create(model=NAME, prompt=p, max_tokens=8)
                                     .choices[0].text, prompts))

        assert texts(sdk) == texts(client)
        assert set(worker_requests(tree)) == {"0", "1"}
        chunks = list(sdk.completions.create(model=NAME, prompt="stream me", max_tokens=20, stream=True,
                                             stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            client.completions.create(model=NAME, prompt="stream me", max_tokens=20).choices[0].text
        assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [20]
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
        chat = list(sdk.chat.completions.create(model=NAME, messages=messages, max_tokens=10, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == \
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=10).choices[0].message.content
        with pytest.raises(openai.BadRequestError) as exc:
            sdk.completions.create(model=NAME, prompt="x", max_tokens=2, best_of=2)
        assert exc.value.body["param"] == "best_of"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            sdk.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    finally:
        tree.proc.stop(timeout=40)
