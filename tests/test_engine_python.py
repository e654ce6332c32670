"""The engine through its Python bindings (llama-cpp-python, `make engine-python`): `Llama` on a
converted GGUF continues prompts that wrap the window cache as the PyTorch conversion does, with the
window cache at full size (the bindings' default, `swa_full`) and at its own size; successive
prompts that share a start (the bindings try to reuse their cached prefix; a hybrid memory refuses a
partial removal, so they recompute); `create_completion`'s text; and the bindings' OpenAI-compatible
server (`python -m llama_cpp.server`). Skipped where the bindings are not installed."""

from __future__ import annotations

import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine import exported  # noqa: F401  (the fixture: tiny conversions and their GGUFs)
from test_engine import greedy_generation, real_conversion, relative_error
from test_engine_server import free_port, post, served
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


def bindings_server(gguf: Path, context: int):
    """`python -m llama_cpp.server` on a free localhost port until the block ends; yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(context), "--n_threads", "2"]
    return served(command, port, "/v1/models", gguf.with_suffix(".bindings-server.log"))


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


class Sequences:
    """Several sequences in one llama.cpp context through the library's C API (the bindings'
    ctypes): `n_seq` sequences, ubatches of 32 (the window cache: 256 cells per stream), a
    unified cache or one stream per sequence, an F32 cache and no flash attention (as the parity
    tool runs: docs/engine.md)."""

    def __init__(self, gguf: Path, n_seq: int, unified: bool, n_batch: int = 256):
        api = self.api = llama_cpp.llama_cpp
        api.llama_backend_init()
        self.model = api.llama_model_load_from_file(str(gguf).encode(), api.llama_model_default_params())
        params = api.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 2048 * n_seq, n_batch, 32, n_seq
        params.n_threads = params.n_threads_batch = 2
        params.swa_full, params.kv_unified = False, unified
        params.type_k = params.type_v = api.GGML_TYPE_F32
        params.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_DISABLED  # on the CPU it reads the cache as F16
        self.ctx = api.llama_init_from_model(self.model, params)
        self.n_batch = n_batch
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.batch = api.llama_batch_init(n_batch, 0, n_seq)

    def close(self):
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)
        self.api.llama_model_free(self.model)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        """Decodes `entries` (sequence, position, token, wants logits) in batches of `n_batch`
        in the given order; returns the logits `[V]` asked for, by sequence (one per sequence)."""
        out = {}
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            self.batch.n_tokens = len(chunk)
            for i, (seq, pos, token, wants) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, pos, 1
                self.batch.seq_id[i][0], self.batch.logits[i] = seq, wants
            assert self.api.llama_decode(self.ctx, self.batch) == 0
            out |= {seq: np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)).copy()
                    for i, (seq, _, _, wants) in enumerate(chunk) if wants}
        return out

    def copy(self, source: int, target: int):
        self.api.llama_memory_seq_cp(self.api.llama_get_memory(self.ctx), source, target, -1, -1)

    def greedy(self, first: list[np.ndarray], positions: list[int], steps: int) -> list[list[int]]:
        """From each sequence's last logits `first[s]` (its length `positions[s]`), `steps` greedy tokens
        for all sequences at once, one token per sequence per batch."""
        tokens = [[int(row.argmax())] for row in first]
        for step in range(1, steps):
            rows = self.decode([(s, positions[s] + step - 1, tokens[s][-1], True) for s in range(len(first))])
            for s in range(len(first)):
                tokens[s].append(int(rows[s].argmax()))
        return tokens


def interleaved(prompts: list[torch.Tensor], chunk: int, offset: int = 0, seqs: list[int] | None = None):
    """The prompts' tokens as batch entries, `chunk` tokens of each sequence in turn, so each batch
    holds several sequences of different lengths; the last token of each asks for logits."""
    seqs = seqs if seqs is not None else list(range(len(prompts)))
    entries = []
    for start in range(0, max(p.shape[1] for p in prompts), chunk):
        for seq, prompt in zip(seqs, prompts):
            ids = prompt[0].tolist()
            entries += [(seq, offset + i, ids[i], i == len(ids) - 1) for i in range(start, min(start + chunk, len(ids)))]
    return entries


@pytest.mark.parametrize("unified", [True, False], ids=["unified cache", "a stream per sequence"])
@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_sequences_of_different_lengths_decoded_together_each_continue_as_pytorch_does(exported, kind, unified):
    """Four prompts of 1,100, 517, 300 and 64 tokens in shared batches of 256 (ubatches of 32 split
    across the sequences), then 16 greedy steps with one token of each sequence per batch: each
    prompt's last logits within 1e-5 relative of PyTorch's (measured: 3e-7 to 1.2e-6), each
    continuation PyTorch's."""
    converted, gguf = exported("llama", kind)
    generator = torch.Generator().manual_seed(11)
    asked = [random_prompt(n, generator) for n in (1100, 517, 300, 64)]
    engine = Sequences(gguf, len(asked), unified)
    try:
        by_sequence = engine.decode(interleaved(asked, chunk=48))
        last = [by_sequence[s] for s in range(len(asked))]
        tokens = engine.greedy(last, [p.shape[1] for p in asked], 16)
    finally:
        engine.close()
    for prompt, row, got in zip(asked, last, tokens):
        with torch.no_grad():
            reference = converted(prompt).logits[0, -1].numpy()
        assert relative_error(row, reference) < 1e-5
        assert got == greedy_generation(converted, prompt, 16)[0]


@pytest.mark.parametrize("unified", [True, False], ids=["unified cache", "a stream per sequence"])
@pytest.mark.parametrize("kind", ["window+mamba2", "window"])
def test_sequences_that_share_a_prompt_and_then_diverge_each_continue_as_pytorch_does(exported, kind, unified):
    """A 700-token prompt (the window cache has wrapped) copied to three more sequences with
    `llama_memory_seq_cp`, each then given its own continuation (none, 40, 150 and 333 tokens, in
    shared batches), then 16 greedy steps together: each prompt's last logits within 1e-5 relative
    of PyTorch's and each answer PyTorch's for the shared prompt and its own continuation."""
    converted, gguf = exported("llama", kind)
    generator = torch.Generator().manual_seed(12)
    shared = random_prompt(700, generator)
    endings = [random_prompt(n, generator) for n in (40, 150, 333)]
    engine = Sequences(gguf, 4, unified)
    try:
        last = engine.decode(interleaved([shared], chunk=256))
        for seq in (1, 2, 3):
            engine.copy(0, seq)
        last |= engine.decode(interleaved(endings, chunk=64, offset=700, seqs=[1, 2, 3]))
        lengths = [700] + [700 + e.shape[1] for e in endings]
        tokens = engine.greedy([last[s] for s in range(4)], lengths, 16)
    finally:
        engine.close()
    for got, row, prompt in zip(tokens, [last[s] for s in range(4)], [shared] + [torch.cat([shared, e], 1) for e in endings]):
        with torch.no_grad():
            assert relative_error(row, converted(prompt).logits[0, -1].numpy()) < 1e-5
        assert got == greedy_generation(converted, prompt, 16)[0]
