"""`serve --model DIR`: any local Hugging Face causal-LM directory, loaded without a network."""

from __future__ import annotations

import json
from pathlib import Path

import requests

from gpu_watchdog.benchmarks.make_model import make
from tests.helpers import start_server


def test_serves_a_local_hugging_face_directory(tmp_path: Path) -> None:
    model_dir = make(tmp_path / "tiny-llama", hidden=64, layers=2, heads=4, vocab=300, context=256, seed=1)
    srv = start_server(tmp_path, "--model", str(model_dir), "--max-tokens-limit", "64",
                       env={"HF_HUB_OFFLINE": "1"})
    try:
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "héllo wörld", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny-llama"
        assert body["usage"]["prompt_tokens"] == len("héllo wörld".encode())  # byte-level tokenizer
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        with requests.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True},
                           stream=True, timeout=60) as s:
            lines = [ln for ln in s.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        # The model's own context bounds the prompt.
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 1}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
        mem = srv.memory()
        assert mem["model"] == "tiny-llama" and mem["device"] == "cpu"
    finally:
        srv.proc.stop()


def test_a_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "serve", "--model", str(tmp_path / "nope"),
                          "--port", "18999", "--control-port", "18998"], capture_output=True, text=True, timeout=120,
                         env={"GPU_WATCHDOG_TOKEN": "t", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "not a directory" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
