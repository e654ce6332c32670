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
from concurrent.futures import ThreadPoolExecutor
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
def served(command: list[str], port: int, ready: str, log: Path):
    """The HTTP server `command` (listening on localhost `port`, its log into `log`) until the
    block ends, once `ready` (a path) answers 200; yields its base URL."""
    with log.open("w") as stderr:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"{command[0]} exited: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(url + ready, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{command[0]} did not come up in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def serving(gguf: Path, context: int, *options: str, log: Path | None = None):
    """`llama-server` on a free localhost port, until the block ends; yields its base URL.
    `options`: more flags (default one slot: `-np 1`); `log`: where its log goes (default a
    file next to the GGUF)."""
    port = free_port()
    command = [str(SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(context), "-t", "2", "--jinja", *(options or ("-np", "1"))]
    return served(command, port, "/health", log or gguf.with_suffix(".server.log"))


def test_the_server_completes_a_tiny_conversion_as_pytorch_does(exported):
    converted, gguf = exported("llama", "window+mamba2")
    prompt = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with serving(gguf, 256) as url:
        answer = post(url + "/completion", {"prompt": prompt[0].tolist(), "n_predict": 24, "temperature": 0,
                                            "return_tokens": True, "ignore_eos": True})
    assert answer["tokens"] == greedy_generation(converted, prompt, 24)[0]


# The tiny tokenizer's end token; the server stops there (its `ignore_eos` would not: it bans the
# token, so a greedy answer that ends differs from the model's).
END = 0


def until_end(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(END)] if END in tokens else tokens


def completion(url: str, prompt: list[int], tokens: int) -> list[int]:
    """The server's greedy completion of the token ids `prompt`, at most `tokens` long, up to the
    end token."""
    answer = post(url + "/completion", {"prompt": prompt, "n_predict": tokens, "temperature": 0,
                                        "return_tokens": True, "cache_prompt": True})
    return until_end(answer["tokens"])


def expected(converted, prompt: torch.Tensor, tokens: int) -> list[int]:
    """PyTorch's greedy completion of `prompt` `[1, T]`, up to the end token."""
    return until_end(greedy_generation(converted, prompt, tokens)[0])


def prompts(lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (1, n), generator=generator) for n in lengths]


# Ubatches of 32: the window cache holds 256 cells (16 + 2 sinks + 32, padded), so prompts of
# 1,000+ tokens wrap its ring four times and more.
SMALL_UBATCH = ("-ub", "32", "-b", "256")


@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_the_server_completes_after_a_prompt_that_wraps_the_window_four_times(exported, kind):
    converted, gguf = exported("llama", kind)
    prompt = prompts([1100], seed=4)[0]
    with serving(gguf, 2048, "-np", "1", *SMALL_UBATCH) as url:
        assert completion(url, prompt[0].tolist(), 24) == expected(converted, prompt, 24)


@pytest.mark.parametrize("concurrent", [4, 8])
def test_concurrent_requests_in_the_default_slots_each_get_their_own_greedy_completion(exported, concurrent):
    """The server's default slots (4) and unified cache, `concurrent` requests of different
    lengths at once (8 queue for 4 slots), each long enough to wrap the window cache."""
    converted, gguf = exported("llama", "window+mamba2")
    asked = prompts([1000 + 37 * i for i in range(concurrent)], seed=5)
    with serving(gguf, 4 * 2048, *SMALL_UBATCH) as url, ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda p: completion(url, p[0].tolist(), 16), asked))
    assert answers == [expected(converted, p, 16) for p in asked]


def test_a_cached_prompt_is_reused_by_a_later_request_and_a_cancelled_one_leaves_its_slot_clean(exported):
    """One slot: a 1,100-token request, then one that extends it by 150 tokens (the server reuses
    the cached prompt, restoring its checkpoint of the window cache and the tail's state taken 4
    tokens before the first prompt's end), then a request cancelled after a few streamed tokens,
    then the first again in the same slot."""
    converted, gguf = exported("llama", "window+mamba2")
    first, extension, other = prompts([1100, 150, 1000], seed=6)
    second = torch.cat([first, extension], 1)
    with serving(gguf, 2048, "-np", "1", *SMALL_UBATCH) as url:
        assert completion(url, first[0].tolist(), 16) == expected(converted, first, 16)
        answer = post(url + "/completion", {"prompt": second[0].tolist(), "n_predict": 16, "temperature": 0,
                                            "return_tokens": True, "cache_prompt": True})
        assert answer["timings"]["cache_n"] >= 1000  # the cached prompt was reused, not recomputed
        assert until_end(answer["tokens"]) == expected(converted, second, 16)
        assert cancelled_after(url, other[0].tolist(), streamed=4) == 4
        assert completion(url, first[0].tolist(), 16) == expected(converted, first, 16)


@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_a_request_that_shares_only_the_start_of_a_cached_prompt_is_not_served_from_a_moved_window(exported, kind):
    """After a 1,100-token request, one that shares its first 700 tokens: the window cache's 256
    cells hold the sinks and the positions past ~860, so the window before 700 is gone. The cache
    reports its first position after the sinks' gap (not the sinks' 0), so the server sees that
    it cannot go on from 700 and recomputes (for kind `window`, with no recurrent state to force
    that anyway, reporting 0 made it go on from 700 with the sinks alone); the answer is PyTorch's."""
    converted, gguf = exported("llama", kind)
    shared, first_end, second_end = prompts([700, 400, 150], seed=8)
    first, second = torch.cat([shared, first_end], 1), torch.cat([shared, second_end], 1)
    with serving(gguf, 2048, "-np", "1", *SMALL_UBATCH) as url:
        assert completion(url, first[0].tolist(), 16) == expected(converted, first, 16)
        assert completion(url, second[0].tolist(), 16) == expected(converted, second, 16)


def test_the_window_cache_at_full_size_serves_a_request_that_shares_only_the_start_of_a_cached_prompt(exported):
    """`--swa-full`: the window cache holds the whole context, so after a 1,100-token request one
    that shares its first 700 tokens goes on from 700 (for the kind without a tail, which
    nothing else forces to recompute): the answer is PyTorch's."""
    converted, gguf = exported("llama", "window")
    shared, first_end, second_end = prompts([700, 400, 150], seed=9)
    first, second = torch.cat([shared, first_end], 1), torch.cat([shared, second_end], 1)
    with serving(gguf, 2048, "-np", "1", "--swa-full", *SMALL_UBATCH) as url:
        assert completion(url, first[0].tolist(), 16) == expected(converted, first, 16)
        answer = post(url + "/completion", {"prompt": second[0].tolist(), "n_predict": 16, "temperature": 0,
                                            "return_tokens": True, "cache_prompt": True})
    assert answer["timings"]["cache_n"] >= 650
    assert until_end(answer["tokens"]) == expected(converted, second, 16)


@pytest.mark.parametrize("window_cache", [(), ("--swa-full",)], ids=["own size", "full size"])
def test_context_shift_is_refused_in_one_line_and_a_full_context_ends_the_answer(exported, window_cache, tmp_path):
    """A shift would drop the window's sinks and leave the tail's state holding the dropped
    tokens, so the engine says it cannot shift (at its own size the window cache could not
    anyway; at full size, `--swa-full`, only the architecture's refusal stops it):
    `--context-shift` is turned off with llama.cpp's one-line warning, and an answer that fills
    the context of 512 stops there, its tokens PyTorch's."""
    converted, gguf = exported("llama", "window+mamba2")
    prompt = prompts([400], seed=10)[0]
    log = tmp_path / "server.log"
    with serving(gguf, 512, "-np", "1", "--context-shift", *window_cache, *SMALL_UBATCH, log=log) as url:
        answer = post(url + "/completion", {"prompt": prompt[0].tolist(), "n_predict": 300, "temperature": 0,
                                            "return_tokens": True, "ignore_eos": True})
    assert "KV cache shifting is not supported for this context, disabling KV cache shifting" in log.read_text()
    assert 100 <= len(answer["tokens"]) <= 112
    assert answer["tokens"] == greedy_generation(converted, prompt, len(answer["tokens"]))[0]


def cancelled_after(url: str, prompt: list[int], streamed: int) -> int:
    """Streams a long completion and closes the connection after `streamed` tokens; returns how
    many came."""
    body = {"prompt": prompt, "n_predict": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    came = 0
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: ") and b'"content"' in line:
                came += 1
                if came == streamed:
                    break
    return came


@pytest.mark.real_model
def test_the_server_continues_long_held_out_prompts_as_pytorch_does(tmp_path):
    """The issue's case: after 1,500 and 6,000 tokens of held-out text (the window cache of 768
    cells wraps 2 and 8 times at the server's default ubatch), 24 greedy tokens equal PyTorch's."""
    from recurformer.corpus_sources import shared_corpora
    from recurformer.data import EVAL_CORPORA

    converted, tokenizer = real_conversion(tmp_path / "model")
    export_command(str(tmp_path / "model"), str(tmp_path / "model.gguf"), "f32")
    ids = tokenizer(Path(shared_corpora(EVAL_CORPORA)[0]).read_text()[:40000]).input_ids
    with serving(tmp_path / "model.gguf", 8192) as url:
        for length in (1500, 6000):
            prompt = torch.tensor([ids[:length]])
            answer = post(url + "/completion", {"prompt": prompt[0].tolist(), "n_predict": 24, "temperature": 0,
                                                "return_tokens": True, "ignore_eos": True})
            assert answer["tokens"] == greedy_generation(converted, prompt, 24)[0], length


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
