"""Greedy completions of text prompts, batched with left padding (the generation tasks)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 4,
                       desc: str = "generate", progress: bool = True) -> list[str]:
    """The greedy continuation of each prompt, at most `max_new_tokens` tokens, decoded
    without special tokens. Prompts run `batch_size` at a time, left-padded as generation needs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    completions = []
    model.eval()
    for first in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", disable=not progress):
        encoded = [tokenizer.encode(prompt) for prompt in prompts[first:first + batch_size]]
        width = max(map(len, encoded))
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(encoded):
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            mask[row, width - len(tokens):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return completions
