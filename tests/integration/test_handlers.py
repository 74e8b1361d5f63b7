"""Handlers behind the gate, as clients see them: embeddings through the official `openai` SDK, vLLM's
classify shape, a handler of one's own, bad inputs, OOM split-and-retry and the canary.

The models are generated from a config here (no download); every vector is checked against a
plain in-process `transformers` forward of the same weights.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import requests
import torch

from gpu_watchdog.benchmarks.make_encoder import LABELS, make
from tests.helpers import Server, metric, start_server
from tests.integration.fuzzing import fuzz

TEXTS = ["hello world", "the gpu watchdog probe", "ok", "memory cache queue health canary batch token"]


class Doubler:
    """A handler of one's own, as a user writes it: numbers in, twice the numbers out."""

    capabilities = {"predict"}

    def load(self, model: str | None, device: torch.device) -> None:
        self.factor = torch.tensor(2.0, device=device)

    def decode(self, body: dict[str, Any]) -> list[float]:
        return [float(x) for x in body["inputs"]]

    def predict(self, items: list[float]) -> list[float]:
        return (torch.tensor(items) * self.factor).tolist()

    def encode(self, output: float) -> float:
        return output

    def sample(self) -> float:
        return 1.0


def reference(directory: Path, texts: list[str], pooling: str) -> np.ndarray:
    """The vectors a plain transformers forward gives, one text at a time (no padding)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            v = hidden[0] if pooling == "cls" else hidden.mean(dim=0)
            rows.append(torch.nn.functional.normalize(v, dim=0).numpy())
    return np.stack(rows)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make(root / "bert", "bert")  # no pooling config: the documented default, mean + normalize
    make(root / "roberta", "roberta", pooling="cls")
    make(root / "xlmr", "xlm-roberta", pooling="mean")
    make(root / "classifier", "bert", task="classify", seed=1)
    return root


@pytest.fixture(scope="module")
def bert(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("bert"), "--handler", "embeddings", "--model", str(models / "bert"),
                       "--fault-injection", "--max-batch-size", "8")
    yield srv
    srv.proc.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_through_the_sdk_match_a_plain_forward_in_base64_and_float(bert: Server, models: Path) -> None:
    sdk = client(bert)
    # The SDK asks for base64 when the caller does not choose, and decodes it itself.
    default = sdk.embeddings.create(model="bert", input=TEXTS)
    floats = sdk.embeddings.create(model="bert", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in default.data])
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    assert np.allclose(got, np.array([d.embedding for d in floats.data]), atol=1e-6)
    assert got.shape == (4, 64)
    assert cosines(got, reference(models / "bert", TEXTS, "mean")).min() >= 0.999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    assert default.model == "bert"
    assert default.usage.prompt_tokens == sum(len(t.split()) for t in TEXTS) + 2 * len(TEXTS)
    # Raw base64 is little-endian float32, as OpenAI sends it.
    raw = requests.post(bert.url + "/v1/embeddings", json={"input": "ok", "encoding_format": "base64"}, timeout=30)
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, got[2], atol=1e-6)


def test_token_arrays_embed_like_their_text(bert: Server, models: Path) -> None:
    from transformers import AutoTokenizer

    sdk = client(bert)
    tokens = AutoTokenizer.from_pretrained(models / "bert")(TEXTS[:2])["input_ids"]
    by_text = sdk.embeddings.create(model="bert", input=TEXTS[:2], encoding_format="float")
    # What LangChain sends by default: a list of token-id lists; and one token-id list alone.
    by_ids = sdk.embeddings.create(model="bert", input=tokens)
    one = sdk.embeddings.create(model="bert", input=tokens[1], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-5)
    assert np.allclose(one.data[0].embedding, by_text.data[1].embedding, atol=1e-5)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(tokens[0]) + len(tokens[1])


def test_concurrent_requests_are_batched_and_agree_with_lone_ones(bert: Server) -> None:
    sdk = client(bert)
    alone = [sdk.embeddings.create(model="bert", input=t, encoding_format="float").data[0].embedding for t in TEXTS]
    before = metric(bert.url + "/metrics", "gpu_inference_batch_size_count") or 0.0
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: sdk.embeddings.create(model="bert", input=TEXTS[i % 4],
                                                                 encoding_format="float").data[0].embedding,
                                 range(16)))
    after = metric(bert.url + "/metrics", "gpu_inference_batch_size_count") or 0.0
    for i, v in enumerate(together):
        assert np.allclose(v, alone[i % 4], atol=1e-5)
    assert 0 < after - before <= 16


def test_a_request_larger_than_the_queue_bound_still_gets_in(bert: Server) -> None:
    # 300 inputs against --max-queue 256 (items): refused only once the queue is full.
    r = requests.post(bert.url + "/v1/embeddings", json={"input": ["ok"] * 300, "encoding_format": "base64"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == list(range(300))


def test_bad_inputs_get_400s_naming_the_field(bert: Server) -> None:
    def err(body: Any) -> tuple[int, str | None, str]:
        r = requests.post(bert.url + "/v1/embeddings", json=body, timeout=30)
        e = r.json()["error"]
        return r.status_code, e["param"], e["message"]

    assert err({})[:2] == (400, "input")
    assert err({"input": []})[:2] == (400, "input")
    assert err({"input": ""})[:2] == (400, "input")
    assert err({"input": 42})[:2] == (400, "input")
    assert err({"input": ["a", 3]})[:2] == (400, "input")
    assert err({"input": ["ok", ""]})[:2] == (400, "input[1]")
    assert err({"input": [[1, 2], [1, 10**9]]})[:2] == (400, "input[1]")
    status, field, message = err({"input": "word " * 600})
    assert (status, field) == (400, "input") and "512" in message
    status, field, message = err({"input": ["ok"] * 2049})
    assert (status, field) == (400, "input") and "2048" in message
    assert err({"input": "ok", "encoding_format": "int8"})[:2] == (400, "encoding_format")
    status, field, message = err({"input": "ok", "dimensions": 32})
    assert (status, field) == (400, "dimensions") and "64" in message
    r = requests.post(bert.url + "/v1/embeddings", json={"input": "ok", "dimensions": 64}, timeout=30)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    assert err({"input": "ok", "model": "other"})[:2] == (404, "model")
    with pytest.raises(openai.BadRequestError):
        client(bert).embeddings.create(model="bert", input=[])


def test_routes_the_handler_cannot_serve_say_so(bert: Server) -> None:
    r = requests.post(bert.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and "embeddings" in r.json()["error"]["message"]
    r = requests.post(bert.url + "/v1/classify", json={"input": "hi"}, timeout=30)
    assert r.status_code == 404 and "classifier" in r.json()["error"]["message"]
    assert [m.id for m in client(bert).models.list().data] == ["bert"]


def test_the_published_api_is_the_handlers_and_survives_fuzzing_without_5xx(bert: Server) -> None:
    spec = requests.get(bert.url + "/openapi.json", timeout=10).json()
    assert set(spec["paths"]) == {"/v1/models", "/v1/models/{model}", "/v1/embeddings", "/predict", "/healthz",
                                  "/readyz", "/metrics"}
    body = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"input", "model", "encoding_format", "dimensions", "user"}
    out = fuzz(bert.url + "/openapi.json")
    assert out.returncode == 0, out.stdout[-6000:]
    assert "passed" in out.stdout
    assert requests.post(bert.url + "/v1/embeddings", json={"input": "still here"}, timeout=30).status_code == 200


def test_roberta_and_xlmr_follow_their_pooling_config(models: Path, tmp_path: Path) -> None:
    for name, pooling in (("roberta", "cls"), ("xlmr", "mean")):
        srv = start_server(tmp_path, "--handler", "embeddings", "--model", str(models / name), name=name)
        try:
            got = np.array([d.embedding for d in client(srv).embeddings.create(model=name, input=TEXTS).data])
        finally:
            srv.proc.stop()
        assert cosines(got, reference(models / name, TEXTS, pooling)).min() >= 0.999, name


def test_an_oom_splits_the_batch_and_a_lone_item_gets_a_503(bert: Server) -> None:
    ooms = bert.memory()["ooms_caught"]
    # A simulated card that holds 2 items at once: a batch of 4 runs out of memory, its halves fit.
    bert.fault("memory_cap", sequences=2)
    try:
        r = requests.post(bert.url + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 4
        assert bert.memory()["ooms_caught"] == ooms + 1
    finally:
        bert.fault("clear")
    bert.fault("oom", count=1)
    r = requests.post(bert.url + "/v1/embeddings", json={"input": "ok"}, timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["error"]["type"] == "out_of_memory"
    assert requests.post(bert.url + "/v1/embeddings", json={"input": "ok"}, timeout=30).status_code == 200


def test_the_canary_runs_the_handlers_sample_and_reports_faults(bert: Server) -> None:
    assert bert.ctl("POST", "/control/canary").json()["ok"] is True
    bert.fault("oom", count=1)
    result = bert.ctl("POST", "/control/canary").json()
    assert result["ok"] is False and result["error_class"] == "oom"
    bert.fault("hang")
    try:
        result = bert.ctl("POST", "/control/canary", {"timeout": 0.5}).json()
        assert result["ok"] is False and result["error_class"] == "timeout"
    finally:
        bert.fault("clear")
    assert bert.ctl("POST", "/control/canary", {"timeout": 10}).json()["ok"] is True
    assert requests.get(bert.url + "/readyz", timeout=10).status_code == 200


def test_classify_answers_in_vllms_shape_with_the_models_labels(models: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    srv = start_server(tmp_path, "--handler", "classifier", "--model", str(models / "classifier"), name="cls")
    try:
        r = requests.post(srv.url + "/v1/classify", json={"model": "classifier", "input": TEXTS}, timeout=30)
        plain = requests.post(srv.url + "/classify", json={"input": TEXTS[0]}, timeout=30)
        bad = requests.post(srv.url + "/v1/classify", json={"input": [[]]}, timeout=30)
        embed = requests.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
        paths = set(requests.get(srv.url + "/openapi.json", timeout=10).json()["paths"])
    finally:
        srv.proc.stop()
    assert {"/v1/classify", "/classify"} <= paths and not {"/v1/embeddings", "/v1/completions"} & paths
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "classifier" and body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    tok = AutoTokenizer.from_pretrained(models / "classifier")
    model = AutoModelForSequenceClassification.from_pretrained(models / "classifier").eval()
    with torch.inference_mode():
        expected = [torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1).numpy() for t in TEXTS]
    for i, row in enumerate(body["data"]):
        assert row["index"] == i and row["num_classes"] == 3
        assert np.allclose(row["probs"], expected[i], atol=1e-4)
        assert row["label"] == LABELS[int(np.argmax(expected[i]))]
    assert plain.json()["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0]"
    assert embed.status_code == 404


def test_a_handler_of_ones_own_serves_predict_and_answers_the_canary(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--handler", "tests.integration.test_handlers:Doubler", name="own")
    try:
        r = requests.post(srv.url + "/predict", json={"inputs": [1, 2.5, -3]}, timeout=30)
        models_ = requests.get(srv.url + "/v1/models", timeout=30).json()
        embed = requests.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
        canary = srv.ctl("POST", "/control/canary").json()
        spec = requests.get(srv.url + "/openapi.json", timeout=10).json()
    finally:
        srv.proc.stop()
    assert r.status_code == 200 and r.json() == {"outputs": [2.0, 5.0, -6.0]}
    assert "/predict" in spec["paths"] and "/v1/embeddings" not in spec["paths"]
    assert "outputs" in str(spec["paths"]["/predict"]["post"]["responses"]["200"])
    assert [m["id"] for m in models_["data"]] == ["Doubler"]
    assert embed.status_code == 404
    assert canary["ok"] is True


def test_a_sticky_cuda_error_poisons_the_process_which_exits_3(bert: Server) -> None:
    # Last of the tests on this server: it does not come back.
    bert.fault("context_loss")
    r = requests.post(bert.url + "/v1/embeddings", json={"input": "ok"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "fatal_cuda"
    assert requests.get(bert.url + "/readyz", timeout=10).status_code == 503
    assert bert.ctl("GET", "/control/memory").json()["poisoned"] is True  # reported: no need to linger
    assert bert.proc.proc.wait(timeout=30) == 3


def test_items_are_sized_for_measuring_and_measuring_needs_cuda(models: Path) -> None:
    from gpu_watchdog.inference.engine import Engine
    from gpu_watchdog.inference.handlers.embeddings import Embeddings
    from gpu_watchdog.inference.measure import MeasureError, measure_items

    handler = Embeddings()
    handler.load(str(models / "bert"), torch.device("cpu"))
    for tokens in (3, 16, handler.max_tokens):
        item = handler.sized_sample(tokens)
        assert len(item) == tokens and item[0] == 2 and item[-1] == 3  # [CLS] ... [SEP]
    engine = Engine(handler)
    try:
        assert len(engine.predict_now([handler.sized_sample(handler.max_tokens)])[0]) == 64
        with pytest.raises(MeasureError, match="CUDA"):
            measure_items(engine, handler.sized_sample, handler.max_tokens)
    finally:
        engine.stop()
