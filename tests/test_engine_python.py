"""The engine through its Python bindings (llama-cpp-python, `make engine-python`): `Llama` on a
converted GGUF continues prompts that wrap the window cache as the PyTorch conversion does, with the
window cache at full size (the bindings' default, `swa_full`) and at its own size; successive
prompts that share a start (the bindings try to reuse their cached prefix; a hybrid memory refuses a
partial removal, so they recompute); `create_completion`'s text; and the bindings' OpenAI-compatible
server (`python -m llama_cpp.server`). Skipped where the bindings are not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
import torch
from test_engine import exported  # noqa: F401  (the fixture: tiny conversions and their GGUFs)
from test_engine import greedy_generation, real_conversion
from test_engine_server import free_port, post
from tiny_models import tiny_tokenizer

from recurformer.export import export_command

llama_cpp = pytest.importorskip("llama_cpp", reason="the engine's Python bindings are not installed (make engine-python)")


def bindings(gguf: Path, **options):
    """`Llama` on `gguf`: a context of 2,048 in ubatches of 32 (the window cache: 256 cells)."""
    return closing(llama_cpp.Llama(str(gguf), n_ctx=2048, n_batch=256, n_ubatch=32, n_threads=2, verbose=False,
                                   **options))


def continued(llm, prompt: torch.Tensor, tokens: int) -> list[int]:
    """The bindings' greedy continuation of `prompt` `[1, T]`, exactly `tokens` long."""
    got = []
    for token in llm.generate(prompt[0].tolist(), temp=0.0):
        got.append(token)
        if len(got) == tokens:
            return got


def random_prompt(length: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 97, (1, length), generator=generator)


@pytest.mark.parametrize("swa_full", [None, False], ids=["default full-size window cache", "window cache at its size"])
@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_the_bindings_continue_prompts_that_share_a_start_as_pytorch_does(exported, kind, swa_full):
    """A 1,100-token prompt (the 256-cell window cache wraps four times), then one that shares
    only its first 700 tokens, then one that extends the second: each continuation is PyTorch's."""
    converted, gguf = exported("llama", kind)
    generator = torch.Generator().manual_seed(4)
    first = random_prompt(1100, generator)
    second = torch.cat([first[:, :700], random_prompt(300, generator)], 1)
    third = torch.cat([second, random_prompt(100, generator)], 1)
    with bindings(gguf, swa_full=swa_full) as llm:
        for prompt in (first, second, third):
            assert continued(llm, prompt, 24) == greedy_generation(converted, prompt, 24)[0]


def test_create_completion_answers_the_token_ids_of_a_long_prompt_with_pytorchs_text(exported):
    converted, gguf = exported("llama", "window+mamba2")
    prompt = random_prompt(1100, torch.Generator().manual_seed(6))
    with bindings(gguf, swa_full=False) as llm:
        answer = llm.create_completion(prompt[0].tolist(), max_tokens=24, temperature=0.0)
    tokens = greedy_generation(converted, prompt, 24)[0]
    if 0 in tokens:  # the end token: the bindings stop there
        tokens = tokens[:tokens.index(0)]
    assert answer["choices"][0]["text"] == tiny_tokenizer().decode(tokens)


@contextmanager
def bindings_server(gguf: Path, context: int):
    """`python -m llama_cpp.server` on a free localhost port until the block ends; yields its URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                               "--port", str(port), "--n_ctx", str(context), "--n_threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"llama_cpp.server exited: {server.stderr.read()[-2000:]}"
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server did not come up in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_bindings_openai_server_completes_a_text_as_pytorch_does(exported):
    """The server tokenizes the text as the Hugging Face tokenizer does (checked first) and its
    greedy completion is PyTorch's, decoded."""
    converted, gguf = exported("llama", "window+mamba2")
    text = "The quick brown fox jumps over the lazy dog. A recurrent state has a fixed size; " * 8
    tokenizer = tiny_tokenizer()
    ids = tokenizer(text, return_tensors="pt").input_ids
    with bindings_server(gguf, 1024) as url:
        assert post(url + "/extras/tokenize", {"input": text})["tokens"] == ids[0].tolist()
        answer = post(url + "/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0})
    tokens = greedy_generation(converted, ids, 16)[0]
    if 0 in tokens:
        tokens = tokens[:tokens.index(0)]
    assert answer["choices"][0]["text"] == tokenizer.decode(tokens)


@pytest.mark.real_model
def test_the_bindings_answer_a_chat_with_the_real_conversions_greedy_tokens(tmp_path):
    converted, tokenizer = real_conversion(tmp_path / "model")
    export_command(str(tmp_path / "model"), str(tmp_path / "model.gguf"), "f32")
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    with closing(llama_cpp.Llama(str(tmp_path / "model.gguf"), n_ctx=1024, n_threads=2, verbose=False)) as llm:
        answer = llm.create_chat_completion(messages, max_tokens=32, temperature=0.0)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    tokens = greedy_generation(converted, prompt["input_ids"], 32)[0]
    end = tokens.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in tokens else len(tokens)
    assert answer["choices"][0]["message"]["content"].strip() == tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
