"""The engine's `llama-server` serves a converted GGUF over its HTTP API (docs/engine.md, "Serve"):
started on localhost, asked for a completion (tiny model, token ids in, token ids out) and a chat
completion (the real model, through its chat template), each answer checked against the PyTorch
model's greedy tokens, then stopped. Skipped where the engine's server is not built."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_engine import exported  # noqa: F401  (the fixture: tiny conversions and their GGUFs)
from test_engine import greedy_generation, real_conversion

from recurformer.export import engine_root, export_command

SERVER = engine_root() / "build" / "bin" / "llama-server"
pytestmark = pytest.mark.skipif(not SERVER.exists(), reason="the engine's server is not built (make engine)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextmanager
def serving(gguf: Path, context: int):
    """`llama-server` on a free localhost port, until the block ends; yields its base URL."""
    port = free_port()
    server = subprocess.Popen([str(SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                               "-c", str(context), "-np", "1", "-t", "2", "--jinja"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"llama-server exited: {server.stderr.read()[-2000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server did not come up in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_server_completes_a_tiny_conversion_as_pytorch_does(exported):
    converted, gguf = exported("llama", "window+mamba2")
    prompt = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with serving(gguf, 256) as url:
        answer = post(url + "/completion", {"prompt": prompt[0].tolist(), "n_predict": 24, "temperature": 0,
                                            "return_tokens": True, "ignore_eos": True})
    assert answer["tokens"] == greedy_generation(converted, prompt, 24)[0]


@pytest.mark.real_model
def test_the_server_answers_a_chat_with_the_real_conversions_greedy_tokens(tmp_path):
    converted, tokenizer = real_conversion(tmp_path / "model")
    export_command(str(tmp_path / "model"), str(tmp_path / "model.gguf"), "f32")
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    with serving(tmp_path / "model.gguf", 1024) as url:
        answer = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 32, "temperature": 0})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    tokens = greedy_generation(converted, prompt["input_ids"], 32)[0]
    end = tokens.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in tokens else len(tokens)
    expected = tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert answer["choices"][0]["message"]["content"].strip() == expected.strip()
