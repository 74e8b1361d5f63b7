#!/usr/bin/env bash
# The GPU check: what CPU-only CI cannot verify, in one run (< 8 minutes on one large NVIDIA GPU).
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]
#
# On a GPU image that has torch & co. but no network: first, where the package index is reachable,
# `python -m gpu_watchdog.benchmarks.gpu_wheels` (wheels of what the image lacks into .gpu-wheels/, ~10 MiB);
# the script installs them into a temp folder and runs from the checkout. From a fresh checkout
# with only python3 + pip and network: makes its own venv (torch from PyPI, which is a CUDA build
# on Linux x86_64). Then it checks
#   1. NVML through the watchdog's sampler (memory, utilization, temperature, power, UUID),
#   2. real torch.cuda.memory_stats figures through the control API of a CUDA server, then the
#      watchdog itself watching that server (NVML, allocator, canary, idle-memory baseline),
#   3. the planner measuring M_base / M_peak on the built-in model and on a generated model of a
#      few GB (random init, no download),
#   4. the concurrency sweep in all three modes at high concurrency with long prompts, on a GPU
#      share small enough (--memory-fraction; GPU_CHECK_SHARE_GIB, default 9) that `unbounded`
#      meets real OOMs, and whether `full` stays at zero errors,
#   5. with two GPUs or more: one worker per GPU (the agent's example under uvicorn --workers N,
#      each worker's control API on its own port reporting its own card); skipped on one GPU.
# Everything lands in RESULTS_DIR (default gpu-check-<timestamp>): logs, JSON, Markdown, PNG.
# GPU_CHECK_ALLOW_CPU=1 runs the same steps on a machine without a GPU (CUDA-only steps report
# themselves as skipped) to check the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}")
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SECONDS=0
FAILED=  # steps whose checks failed; the run goes on so one failure does not hide the rest
step() { echo; echo "=== [$SECONDS s] $*"; }

step "environment"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi not available"
NEEDED='import torch, transformers, aiohttp, prometheus_client, structlog, kubernetes, yaml, pynvml, requests, tokenizers, grpc, google.protobuf'
# A machine without network (the GPU machines): the packages its image lacks come along as wheels,
# made where the index is reachable by `python -m gpu_watchdog.benchmarks.gpu_wheels` (default .gpu-wheels/).
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
if [ -z "${GPU_CHECK_VENV:-}" ] && [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE (no network)"
fi
if [ -z "${GPU_CHECK_VENV:-}" ] && python3 -c "$NEEDED" 2>/dev/null; then
  # A GPU image with the packages already there (possibly offline): run from the checkout as is.
  PY=python3
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "using the system python3 and its packages (no install from the index)"
elif [ -d "$WHEELS" ] && [ -z "${GPU_CHECK_VENV:-}" ]; then
  python3 -c "$NEEDED" || true
  echo "the wheels in $WHEELS do not complete python3's packages (above); refusing to reach for the network"
  exit 2
else
  VENV=${GPU_CHECK_VENV:-.venv-gpu}
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q -e '.[inference,dev]'
  fi
  PY="$VENV/bin/python"
fi
gw() { "$PY" -m gpu_watchdog "$@"; }
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' | tee "$OUT/torch.txt"
if [ "$CUDA" != 1 ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
  echo "no CUDA device: this check needs a GPU (GPU_CHECK_ALLOW_CPU=1 to dry-run on a CPU)"; exit 2
fi
DEVICE=$([ "$CUDA" = 1 ] && echo cuda || echo cpu)

step "1. NVML through the watchdog's sampler"
"$PY" - "$OUT/nvml.json" <<'PYEOF'
import asyncio, dataclasses, json, sys, time
from gpu_watchdog.watchdog.edge.samplers.nvml import NvmlSampler, PynvmlBackend
s = NvmlSampler(PynvmlBackend(), time.monotonic)
s.open()
# None: the one GPU NVML sees (with several visible and none named, the sampler reads none).
samples = [dataclasses.asdict(asyncio.run(s.sample(None)).gpus[0]) for _ in range(3)]
s.close()
json.dump(samples, open(sys.argv[1], "w"), indent=2)
print(json.dumps(samples[-1], indent=2))
ok = samples[-1]["available"] and samples[-1]["memory_total_bytes"] > 0
print("NVML sampler:", "OK" if ok else "UNAVAILABLE")
# The driver's word (NVML field 230) as the sampler read it, and NVML's own answer for the field.
from gpu_watchdog.watchdog.core.xid_catalog import recovery_action
ra = samples[-1]["recovery_action"]
print("GPU recovery action:", "none read (NVML unavailable, or a driver without the field)" if ra is None else
      f"{ra} {recovery_action(ra).name if ra else 'NONE'}")
try:
    import pynvml
    pynvml.nvmlInit()
    [fv] = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(0),
                                           [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    print("  field 230: nvmlReturn", fv.nvmlReturn, "valueType", fv.valueType, "uiVal", fv.value.uiVal)
    pynvml.nvmlShutdown()
except Exception as exc:  # no driver here, or bindings without the field
    print("  field 230 not read:", type(exc).__name__, exc)
PYEOF

step "1b. decoding with the KV cache equals recomputing every step, alone and batched (this torch and transformers)"
"$PY" - "$DEVICE" <<'PYEOF' || FAILED="$FAILED 1b"
import dataclasses, sys, torch, transformers
from gpu_watchdog.inference.engine import Engine, GenRequest
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.model import greedy_without_cache, load_builtin
lm = load_builtin(torch.device(sys.argv[1]))
lm = dataclasses.replace(lm, model=lm.model.float(), dtype=torch.float32)  # no half-precision rounding in the way
print("torch", torch.__version__, "transformers", transformers.__version__, "cache keyword:", lm.cache_kwarg)
engine = Engine(CausalLM(lm))
prompts = [("hello there", 12), ("the quick brown fox", 20), ("x", 7), ("a longer prompt that pads the others", 16)]
references = [lm.codec.decoder().feed(greedy_without_cache(lm, p, n)) for p, n in prompts]
for (prompt, n), reference in zip(prompts, references):
    [r] = engine.generate([GenRequest(prompt_ids=lm.codec.encode(prompt), max_tokens=n)])
    assert r.text == reference, f"cached decoding diverged: {r.text!r} vs {reference!r}"
# Continuous batching: rows of different lengths stitched into one batch and leaving at their own end.
batched = engine.generate([GenRequest(prompt_ids=lm.codec.encode(p), max_tokens=n) for p, n in prompts])
assert [r.text for r in batched] == references, "batched decoding diverged from solo decoding"
print("cached decoding, alone and batched: OK; largest batch", engine.probe().largest_batch)
engine.stop()
# Prompts over the prefill budget in chunks, and beginnings reused from the prefix cache, on this device.
chunked = Engine(CausalLM(lm), prefill_tokens=8)
chunked.enable_prefix_cache(64 << 20)
shared = "a shared beginning, long enough for two whole blocks of the cache: "
more = [(shared + "one", 10), (shared + "two", 10), ("the quick brown fox", 20)]
expected = [lm.codec.decoder().feed(greedy_without_cache(lm, p, n)) for p, n in more]
got = [chunked.generate([GenRequest(prompt_ids=lm.codec.encode(p), max_tokens=n)])[0] for p, n in more]
assert [r.text for r in got] == expected, "chunked or cache-reusing prefill diverged"
assert got[1].cached_tokens >= 32, f"the shared beginning was not reused: {got[1].cached_tokens}"
print("chunked prefill and prefix cache: OK; cached tokens", [r.cached_tokens for r in got])
chunked.stop()
PYEOF

step "2. allocator figures through the control API ($DEVICE)"
export GPU_WATCHDOG_TOKEN=gpu-check-token
read -r PORT CONTROL_PORT WPORT < <("$PY" -c 'from gpu_watchdog.benchmarks._procs import free_port; print(free_port(), free_port(), free_port())')
"$PY" -m gpu_watchdog serve --device "$DEVICE" --host 127.0.0.1 --port "$PORT" --control-port "$CONTROL_PORT" > "$OUT/serve-builtin.log" 2>&1 &
SERVE=$!
WD=
trap 'kill $SERVE $WD 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf "localhost:$PORT/readyz" >/dev/null && break; sleep 0.5; done
CLIENTS=()
for i in $(seq 1 16); do
  curl -s "localhost:$PORT/v1/completions" -d "{\"prompt\": \"warm $i\", \"max_tokens\": 64}" >/dev/null & CLIENTS+=($!)
done
wait "${CLIENTS[@]}"
curl -s -H "Authorization: Bearer $GPU_WATCHDOG_TOKEN" "localhost:$CONTROL_PORT/control/memory" | tee "$OUT/memory.json"; echo
"$PY" - "$OUT/memory.json" "$OUT/nvml.json" <<'PYEOF' || FAILED="$FAILED 2"
import json, sys
m = json.load(open(sys.argv[1])); n = json.load(open(sys.argv[2]))[-1]
print("device", m["device"], "reserved", m["reserved_bytes"], "allocated", m["allocated_bytes"],
      "active", m["active_bytes"], "fragmentation", round(m["fragmentation_ratio"], 4))
print("admission", m["admission"], "engine", m["engine"])
# Forward passes run on at most `limit` threads (+1 that warmed up), however many requests queued.
assert m["engine"]["threads"] <= m["admission"]["limit"] + 1, "more GPU threads than the admission limit"
if m["device"] == "cuda":
    assert m["reserved_bytes"] > 0 and m["total_bytes"] > 0, "CUDA allocator figures missing"
    assert n.get("uuid") in (None, m["uuid"]) or not n["available"], f"UUID mismatch: {m['uuid']} vs NVML {n['uuid']}"
    print("control API figures: OK; UUID matches NVML:", m["uuid"] == n.get("uuid"))
else:
    print("cpu: allocator figures are zeros by design (skipped)")
PYEOF

step "2b. the watchdog watching that server: NVML, allocator, canary, idle memory"
cat > "$OUT/watchdog.yaml" <<YAML
target: {control_url: "http://127.0.0.1:$CONTROL_PORT", token_file: null,
         metrics_url: "http://127.0.0.1:$PORT/metrics"}
sampling: {nvml_interval: 500ms, torch_interval: 1s, server_interval: 1s}
canary: {interval: 2s, timeout: 10s}
restart: {strategy: none}
server: {host: 127.0.0.1, port: $WPORT}
YAML
"$PY" -m gpu_watchdog run --config "$OUT/watchdog.yaml" > "$OUT/watchdog.log" 2>&1 &
WD=$!
for _ in $(seq 1 120); do curl -sf "localhost:$WPORT/readyz" >/dev/null && break; sleep 0.5; done
sleep 3  # a few allocator samples at idle: the baseline for idle memory growth
curl -s "localhost:$WPORT/status" > "$OUT/watchdog-status.json"
curl -s "localhost:$WPORT/metrics" > "$OUT/watchdog-metrics.txt"
"$PY" - "$OUT/watchdog-status.json" "$OUT/memory.json" <<'PYEOF' || FAILED="$FAILED 2b"
import json, sys
st = json.load(open(sys.argv[1])); m = json.load(open(sys.argv[2]))
gpus, torch = st["last_samples"]["gpus"], st["last_samples"]["torch"]
gpu = gpus[0] if gpus else None
print("states", st["states"], "ready", st["ready"], "nvml", st["nvml"], "gpus", st["gpus"])
print("server metrics", st["server_metrics"])
assert st["server_metrics"]["last"] and st["server_metrics"]["last"]["server"] == "bundled", "own /metrics not read"
print("idle memory", st["idle_memory"])
assert st["ready"], "the watchdog never saw a successful canary"
assert torch and torch["reachable"], "no allocator sample through the control API"
if m["device"] == "cuda":
    assert gpu and gpu["available"] and gpu["uuid"] == m["uuid"], f"NVML did not follow the server's GPU: {gpu}"
    assert st["idle_memory"] and st["idle_memory"]["baseline_bytes"] > 0, "no idle-memory baseline on CUDA"
    print("watchdog on a real GPU: OK")
else:
    assert st["idle_memory"] is None, "idle memory must not be followed without a CUDA allocator"
    print("cpu: NVML and idle memory skipped")
PYEOF
kill $WD $SERVE; wait $WD $SERVE 2>/dev/null || true; trap - EXIT

step "3a. planner measuring the built-in model"
gw plan --max-input 512 --max-output 512 | tee "$OUT/plan-builtin.txt" || echo "(plan needs CUDA: skipped)"

step "3b. planner measuring a generated model of a few GB"
# Outside the results folder: a few GB of weights must not travel with the results.
BIG="$(mktemp -d)/model-big"
trap 'rm -rf "$(dirname "$BIG")"' EXIT
if [ "$CUDA" = 1 ]; then
  # Wide and shallow (1.5 B parameters, 2.7 GiB in bf16): big enough for real memory figures, few
  # enough layers that Python's per-token overhead keeps the sweep below within the time budget.
  "$PY" -m gpu_watchdog.benchmarks.make_model "$BIG" --hidden 4096 --layers 6 --heads 32 --vocab 32000 --context 4096
else
  "$PY" -m gpu_watchdog.benchmarks.make_model "$BIG" --hidden 128 --layers 2 --heads 4 --vocab 512 --context 1024
fi
gw plan --model "$BIG" --max-input 2048 --max-output 1024 | tee "$OUT/plan-big.txt" || echo "(plan needs CUDA: skipped)"

step "4. concurrency sweep: unbounded vs semaphore vs full, long prompts, a small GPU share"
if [ "$CUDA" = 1 ]; then
  # A share of the card (default 9 GiB: the model plus ~6 GiB) small enough that 64 unbounded
  # sequences of 2048+128 tokens (~210 MiB of KV cache each) cannot all fit, while 8 can.
  FRACTION=${GPU_CHECK_FRACTION:-$("$PY" -c "import torch, os; share = float(os.environ.get('GPU_CHECK_SHARE_GIB', '9')) * 2**30; print(round(min(0.95, share / torch.cuda.get_device_properties(0).total_memory), 4))")}
  echo "each server capped at $FRACTION of the GPU's memory"
  "$PY" -m gpu_watchdog.benchmarks.concurrency --device cuda --model "$BIG" --concurrency 16,64 --requests 64 \
    --prompt-len 2048 --max-tokens 128 --slots 8 --max-batch 16 --memory-fraction "$FRACTION" \
    --out "$OUT" --stem sweep-gpu
else
  "$PY" -m gpu_watchdog.benchmarks.concurrency --device cpu --concurrency 2,8 --requests 8 --max-tokens 8 \
    --out "$OUT" --stem sweep-cpu-dry-run
fi
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("sweep-*.json")):
    rows = json.load(open(f))
    for mode in ("unbounded", "semaphore", "full"):
        log = out / "logs" / f"{f.stem}-{mode}.log"
        ooms = sum('"event": "oom"' in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0
        errors = sum(r["errors"] for r in rows if r["mode"] == mode)
        retries = sum(r["retries"] for r in rows if r["mode"] == mode)
        print(f"{f.name} {mode}: OOMs inside the server {ooms}, retries {retries}, errors after retries {errors}")
PYEOF
step "5. one worker per GPU: the agent's example under uvicorn --workers N, worker k on card k"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -lt 2 ]; then
  echo "skipped: $NGPU GPU(s) visible; one worker per GPU needs two or more"
elif ! "$PY" -c 'import fastapi, uvicorn' 2>/dev/null; then
  echo "skipped: fastapi and uvicorn are not installed here (pip install fastapi uvicorn)"
else
  APORT=$("$PY" -c 'from gpu_watchdog.benchmarks._procs import free_port; print(free_port())')
  # The workers take consecutive control ports: the first of a run free for all of them.
  ABASE=$("$PY" -c "from gpu_watchdog.benchmarks._procs import free_ports; print(free_ports($NGPU))")
  PREDICT_ARGS="--control-port $ABASE" "$PY" -m uvicorn --app-dir examples/fastapi_service app:create_app --factory \
    --workers "$NGPU" --host 127.0.0.1 --port "$APORT" > "$OUT/agent-workers.log" 2>&1 &
  AGENTS=$!
  trap 'kill $AGENTS 2>/dev/null || true; rm -rf "$(dirname "$BIG")"' EXIT
  for k in $(seq 0 $((NGPU - 1))); do  # every worker up: its control API answers on its port
    for _ in $(seq 1 240); do
      curl -sf -H "Authorization: Bearer $GPU_WATCHDOG_TOKEN" "localhost:$((ABASE + k))/control/memory" >/dev/null && break
      sleep 0.5
    done
  done
  for i in $(seq 1 $((4 * NGPU))); do
    curl -s "localhost:$APORT/predict" -H 'Content-Type: application/json' -d "{\"inputs\": \"hello $i\"}" >/dev/null || true
  done
  for k in $(seq 0 $((NGPU - 1))); do
    curl -s -H "Authorization: Bearer $GPU_WATCHDOG_TOKEN" "localhost:$((ABASE + k))/control/memory" > "$OUT/agent-worker-$k.json" || true
  done
  "$PY" - "$OUT" "$NGPU" <<'PYEOF' || FAILED="$FAILED 5"
import json, pathlib, sys
out, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def report(k):
    try:
        return json.loads((out / f"agent-worker-{k}.json").read_text())
    except (OSError, ValueError):
        return None
reports = [report(k) for k in range(n)]
for k, m in enumerate(reports):
    print(f"worker {k}:", None if m is None else {key: m.get(key) for key in ("pid", "device", "uuid", "reserved_bytes")})
assert all(m is not None for m in reports), "a worker's control API did not answer on its port"
assert len({m["pid"] for m in reports}) == n, "two ports answered by one process"
assert len({m["uuid"] for m in reports}) == n, "two workers report the same GPU: not one worker per card"
assert all(m["device"] == "cuda" and m["reserved_bytes"] > 0 for m in reports), "a worker is not on its GPU"
print(f"{n} workers, each on its own GPU: OK")
PYEOF
  kill $AGENTS 2>/dev/null || true; wait $AGENTS 2>/dev/null || true
  trap 'rm -rf "$(dirname "$BIG")"' EXIT
fi

step "6. one worker per GPU: serve --workers N behind one port, worker k on card k"
if [ "$NGPU" -lt 2 ]; then
  echo "skipped: $NGPU GPU(s) visible; serve --workers needs two or more"
else
  SPORT=$("$PY" -c 'from gpu_watchdog.benchmarks._procs import free_port; print(free_port())')
  SBASE=$("$PY" -c "from gpu_watchdog.benchmarks._procs import free_ports; print(free_ports($NGPU))")
  "$PY" -m gpu_watchdog serve --device cuda --host 127.0.0.1 --port "$SPORT" --control-port "$SBASE" \
    --workers "$NGPU" > "$OUT/serve-workers.log" 2>&1 &
  SERVE_W=$!
  trap 'kill $SERVE_W 2>/dev/null || true; rm -rf "$(dirname "$BIG")"' EXIT
  for _ in $(seq 1 480); do
    curl -sf "localhost:$SPORT/readyz" | "$PY" -c "import json,sys; d=json.load(sys.stdin); sys.exit(len(d['workers_ready']) != $NGPU)" \
      2>/dev/null && break
    sleep 0.5
  done
  "$PY" - "$OUT" "$NGPU" "$SPORT" "$SBASE" <<'PYEOF' || FAILED="$FAILED 6"
import json, os, pathlib, sys, urllib.error, urllib.request
from concurrent.futures import ThreadPoolExecutor
out, n, port, base = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
auth = {"Authorization": f"Bearer {os.environ['GPU_WATCHDOG_TOKEN']}"}
body = json.dumps({"prompt": "one worker per GPU", "max_tokens": 8}).encode()
def complete(_):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1
with ThreadPoolExecutor(8 * n) as pool:
    codes = list(pool.map(complete, range(32 * n)))
def memory(k):
    req = urllib.request.Request(f"http://127.0.0.1:{base + k}/control/memory", headers=auth)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())
reports = [memory(k) for k in range(n)]
(out / "serve-workers.json").write_text(json.dumps({"codes": codes, "workers": reports}, indent=1))
for k, m in enumerate(reports):
    print(f"worker {k}:", {key: m.get(key) for key in ("pid", "device", "uuid", "reserved_bytes")},
          "limit", m["admission"]["limit"], "peak", m["admission"]["peak_holders"])
assert codes == [200] * len(codes), f"not every request answered 200: {sorted(set(codes))}"
assert len({m["uuid"] for m in reports}) == n, "two workers report the same GPU: not one worker per card"
assert all(m["device"] == "cuda" and m["reserved_bytes"] > 0 for m in reports), "a worker is not on its GPU"
assert all(m["admission"]["peak_holders"] <= m["admission"]["limit"] for m in reports), "a worker past its limit"
print(f"serve --workers {n}: {len(codes)} requests, each worker on its own GPU within its own measured limit: OK")
PYEOF
  kill $SERVE_W 2>/dev/null || true; wait $SERVE_W 2>/dev/null || true
  trap 'rm -rf "$(dirname "$BIG")"' EXIT
fi

step "done in $SECONDS s; results in $OUT"
ls -la "$OUT"
if [ -n "$FAILED" ]; then echo "CHECKS FAILED in step(s):$FAILED"; exit 1; fi
echo "all checks passed"
