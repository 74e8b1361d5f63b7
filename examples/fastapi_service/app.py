"""A FastAPI service around a Hugging Face model, watched by gpu-watchdog through the in-process agent.

    python examples/fastapi_service/app.py --port 8000 --control-port 8001 [--fault-injection] [--model DIR]

Or with several workers, one per GPU where there are several (the flags in PREDICT_ARGS):

    PREDICT_ARGS="--control-port 8001" uvicorn --app-dir examples/fastapi_service app:create_app --factory --workers 2

`POST /predict {"inputs": "..."}` runs the model in FastAPI's thread pool. The lines marked
`# agent` are all the watchdog needs; the rest is the service as a team would write it.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from gpu_watchdog.inference.agent import Agent, AgentSettings  # agent
from gpu_watchdog.inference.agent_asgi import install  # agent


class ByteTokenizer:
    """The built-in tiny model's tokenizer: one token per byte, no download."""

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([list(text.encode("utf-8"))[-512:] or [32]])}

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def load(model_dir: str | None, device: torch.device) -> tuple[Any, Any]:
    if model_dir is None:
        torch.manual_seed(1234)
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                             pad_token_id=0, bos_token_id=1, eos_token_id=None)
        tiny: Any = LlamaForCausalLM(config)
        return tiny.to(device).eval(), ByteTokenizer()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return model.to(device).eval(), tokenizer


class PredictIn(BaseModel):
    inputs: str = Field(min_length=1, max_length=4096)
    max_new_tokens: int = Field(default=8, ge=1, le=64)


def build(args: argparse.Namespace) -> tuple[FastAPI, Agent]:
    agent = Agent(AgentSettings(limit=args.limit, control_port=args.control_port,  # agent
                                fault_injection=args.fault_injection, token_file=args.token_file))  # agent
    agent.start()  # agent: this worker's control port, the k-th of the range for the k-th worker
    device = agent.device  # agent: the k-th worker's GPU is card k (one worker per GPU), else cpu
    model, tokenizer = load(args.model, device)

    def generate(text: str, max_new_tokens: int) -> str:
        batch = {k: v.to(device) for k, v in tokenizer(text, return_tensors="pt").items()}
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return str(tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))

    app = FastAPI(title="predict")
    agent.register_canary(lambda: generate("ping", 1))  # agent
    install(app, agent)  # agent

    @app.post("/predict")
    def predict(body: PredictIn) -> dict[str, str]:
        # A plain `def`: FastAPI runs it in its thread pool, off the event loop.
        with agent.admit():  # agent
            return {"outputs": generate(body.inputs, body.max_new_tokens)}

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app, agent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-port", type=int, default=8001)
    p.add_argument("--model", default=None, help="a local Hugging Face causal-LM directory (default: a tiny built-in)")
    p.add_argument("--limit", type=int, default=4, help="requests in the model at once")
    p.add_argument("--token-file", default=None, help="control token file (GPU_WATCHDOG_TOKEN wins)")
    p.add_argument("--fault-injection", action="store_true")
    return p


def create_app() -> FastAPI:
    """The app for a server that builds it in each worker (`uvicorn ... app:create_app --factory
    --workers N`, gunicorn's uvicorn workers): the flags from PREDICT_ARGS."""
    app, _ = build(parser().parse_args(shlex.split(os.environ.get("PREDICT_ARGS", ""))))
    return app


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    app, _ = build(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
