"""The model card (`README.md`) of a converted or trained model folder.

A card is rendered from a plain dict of facts (`render_model_card`), so any caller can
build one; `folder_facts` reads them from a saved folder's `config.json` (the base model,
the replaced groups, the mixer, the training stages recorded in `config.training`) and
from what the source model says about itself (registry entry, or its own card's
`license`). `write_model_card` writes it atomically; `loading.save_model` and
`save_model_files` call it for every converted folder, and `recurformer run` once more on
its final folder with the run's measured numbers (`facts["results"]`: metrics.json's keys).

The card starts with the Hugging Face metadata block (YAML front matter; every value is
written as JSON, which YAML reads as it is): `base_model` (a hub id, when the source has
one), `library_name`, `license` (when the source names one), `pipeline_tag`, `tags`.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import ReplacementSpec
from .files import write_text_atomic
from .hub import HubModel, KnownModel, ModelResolutionError, local_directory, locate
from .mixers import MixerConfig, kinds_reading

CARD = "README.md"
LIBRARY = "recurformer"
MIB = 2**20


def front_matter(text: str) -> dict[str, str]:
    """The top-level `key: value` scalars of a card's metadata block (lists and nested
    values are skipped; surrounding quotes removed)."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    values = {}
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, colon, value = line.partition(":")
        value = value.strip()
        if colon and key and not key[0].isspace() and value and not value.startswith(("[", "{", "|", ">")):
            values[key.strip()] = value.strip("'\"")
    return values


def _card_license(directory: Path) -> str | None:
    card = directory / CARD
    return front_matter(card.read_text(errors="replace")).get("license") if card.is_file() else None


def source_facts(source_model: str | None) -> dict[str, Any]:
    """What the model a folder was converted from says about itself, found without the
    network: its hub id and revision, licence and description. A source that cannot be
    found any more (a folder since deleted, a hub id gone from the cache) gives its name only."""
    facts: dict[str, Any] = {"source_model": source_model}
    if not source_model:
        return facts
    try:
        found = locate(source_model)
    except ModelResolutionError:
        return facts
    if isinstance(found, KnownModel):
        return {**facts, "base_model": found.hub_repo, "license": found.license or None,
                "base_description": found.description}
    if isinstance(found, HubModel):
        facts.update(base_model=found.repo_id, base_revision=found.revision)
    directory = local_directory(source_model)
    return {**facts, "license": _card_license(directory) if directory is not None else None}


def mixer_shape(mixer: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The mixer's kind and the settings its kind reads among the command-line ones
    (window, sinks, ssd_state, state_dtype), `ssd_state: head_dim` resolved to a number."""
    kind = mixer["kind"]
    shape: dict[str, Any] = {"kind": kind}
    for spec in fields(MixerConfig):  # the command-line fields (`option`s) the kind reads
        if spec.name != "kind" and "help" in spec.metadata and kind in kinds_reading(spec.name):
            value = mixer.get(spec.name, spec.default)
            shape[spec.name] = head_dim if spec.name == "ssd_state" and value == "head_dim" else value
    return shape


def folder_facts(directory: str | Path) -> dict[str, Any]:
    """The facts of the converted model saved in `directory` (its config.json)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    text = config["text_config"]
    spec = ReplacementSpec.from_dict(config["replacement"])
    query_heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // query_heads
    return {
        **source_facts(config.get("source_model")),
        "architecture": text.get("model_type"),
        "layers": spec.num_layers,
        "query_heads": query_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "replaced_groups": [list(group) for group in spec.groups],
        "selection": spec.source or {},
        "mixer": mixer_shape(config["mixer"], head_dim),
        "training": config.get("training") or [],
    }


def _metadata(facts: dict[str, Any]) -> list[str]:
    values = {
        "base_model": facts.get("base_model"),
        "library_name": LIBRARY,
        "license": facts.get("license"),
        "pipeline_tag": "text-generation",
        "tags": [LIBRARY, "hybrid-attention", facts["mixer"]["kind"]],
    }
    return ["---", *(f"{key}: {json.dumps(value)}" for key, value in values.items() if value), "---"]


def _base_name(facts: dict[str, Any]) -> str:
    """The base model as a Markdown link when it is on the hub, else its recorded name."""
    base = facts.get("base_model")
    if not base:
        return f"`{facts.get('source_model') or 'an unrecorded model'}`"
    revision = facts.get("base_revision")
    return f"[{base}](https://huggingface.co/{base})" + (f" (revision `{revision}`)" if revision else "")


def _replaced_layers(groups: list[list[int]]) -> str:
    layers: dict[int, list[int]] = {}
    for layer, head in groups:
        layers.setdefault(layer, []).append(head)
    return "; ".join(f"{layer}: {', '.join(map(str, heads))}" for layer, heads in sorted(layers.items()))


def _what_was_replaced(facts: dict[str, Any]) -> list[str]:
    layers, kv_heads, query_heads = facts["layers"], facts["kv_heads"], facts["query_heads"]
    total, replaced = layers * kv_heads, len(facts["replaced_groups"])
    selection = facts.get("selection") or {}
    chosen = f", chosen by the `{selection['scorer']}` scorer" if selection.get("scorer") else ""
    chosen += f" at beta {selection['beta']}" if selection.get("beta") is not None else ""
    mixer = facts["mixer"]
    settings = ", ".join(f"{name} {value}" for name, value in mixer.items() if name != "kind")
    base = f"- Base model: {_base_name(facts)}"
    if facts.get("base_description"):
        base += f": {facts['base_description']}"
    lines = [
        "## What was replaced",
        "",
        base,
        f"- Shape: {facts['architecture']} architecture, {layers} layers, {query_heads} query heads in {kv_heads} KV "
        f"groups per layer, head_dim {facts['head_dim']}",
        f"- Replaced: {replaced} of {total} KV groups ({replaced / total:.0%}){chosen}. A KV group is one KV head "
        f"and the {query_heads // kv_heads} query heads that read it; the replaced groups keep no KV cache.",
    ]
    if replaced:
        lines.append(f"- Replaced KV heads by layer (layer: heads): {_replaced_layers(facts['replaced_groups'])}")
    lines.append(f"- Mixer: `{mixer['kind']}`" + (f" ({settings})" if settings else ""))
    return lines


def _training(facts: dict[str, Any]) -> list[str]:
    stages = facts.get("training") or []
    if not stages:
        return ["## Training", "", "Not trained after the conversion: the mixers are as `recurformer convert` "
                "initialized them (`recurformer train` recovers the quality the replaced heads took with them)."]
    lines = ["## Training", ""]
    for stage in stages:
        trained = f", trained: {stage['trainable']}" if stage.get("trainable") else ""
        lines.append(f"- `{stage['stage']}` stage: {stage['steps']:,} steps, {stage['tokens']:,} tokens{trained}")
    lines.append(f"- In all: {sum(s['tokens'] for s in stages):,} training tokens")
    return lines


def _shown(results: dict[str, Any], key: str, fmt: str, ratio: str | None = None, ratio_fmt: str = "{:.3f}x") -> str:
    """`results[key]` shown by `fmt` (a str.format pattern), with `results[ratio]` in
    parentheses; empty when the key is missing."""
    if results.get(key) is None:
        return ""
    shown = fmt.format(results[key])
    return shown + (f" ({ratio_fmt.format(results[ratio])})" if ratio and results.get(ratio) is not None else "")


def _results(results: dict[str, Any]) -> list[str]:
    """The table of a run's measured numbers (metrics.json keys); rows whose numbers are
    missing are left out."""
    context = f" at {results['bench_context']:,} tokens" if results.get("bench_context") else ""
    cache = {key: results[key] / MIB for key in ("cache_bytes_original", "cache_bytes_final") if key in results}
    cache["cache_ratio"] = results.get("cache_ratio")
    rows = [
        ("perplexity, held-out text", _shown(results, "ppl_original", "{:.2f}"),
         _shown(results, "ppl_final", "{:.2f}", "ppl_ratio"),
         _shown(results, "ppl_baseline", "{:.2f}", "ppl_baseline_ratio")),
        ("perplexity, out-of-domain text", _shown(results, "ppl_ood_original", "{:.2f}"),
         _shown(results, "ppl_ood_final", "{:.2f}", "ppl_ood_ratio"),
         _shown(results, "ppl_ood_baseline", "{:.2f}", "ppl_ood_baseline_ratio")),
        (f"cache{context}", _shown(cache, "cache_bytes_original", "{:,.1f} MiB"),
         _shown(cache, "cache_bytes_final", "{:,.1f} MiB", "cache_ratio"), ""),
        (f"decode tokens/s{context} (batch 1)", _shown(results, "decode_tokens_per_s_original", "{:.1f}"),
         _shown(results, "decode_tokens_per_s_final", "{:.1f}", "decode_speedup", "{:.2f}x"), ""),
    ]
    shown = [row for row in rows if row[1] or row[2]]
    if not shown:
        return []
    window = results.get("baseline_window")
    rival = f"window at equal cache ({window:,} tokens)" if window else "window at equal cache"
    lines = ["## Measured by `recurformer run`", ""]
    if results.get("quick"):
        lines += ["**A quick run (`--quick`): tiny sizes, the numbers mean nothing.**", ""]
    return [
        *lines,
        "The original model, this model, and the training-free rival: the same groups as a plain sliding window "
        "with the cache bytes of this model's mixers. Ratios to the original in parentheses.",
        "",
        f"| measure | original | this model | {rival} |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in shown),
    ]


HOW_TO_LOAD = """## How to load

```python
import recurformer  # registers the recurformer model type with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```

`model.generate(...)` decodes with the hybrid cache (the kept heads' keys and values, each
mixer's fixed-size state). Needs the `recurformer` package installed."""


def render_model_card(facts: dict[str, Any]) -> str:
    """The card's Markdown. `facts`: as `folder_facts` returns them, plus optionally
    `results` (a run's metrics.json values)."""
    mixer, replaced = facts["mixer"]["kind"], len(facts["replaced_groups"])
    total = facts["layers"] * facts["kv_heads"]
    base = facts.get("base_model") or facts.get("source_model") or "a model"
    intro = (f"{_base_name(facts)} converted by recurformer: "
             f"{replaced} of its {total} attention KV groups are replaced by `{mixer}` mixers, which keep a "
             "fixed-size state instead of a growing KV cache.")
    sections = [
        "\n".join(_metadata(facts)),
        f"# {Path(base).name} with RecurFormer mixers (`{mixer}`)",
        intro,
        "\n".join(_what_was_replaced(facts)),
        "\n".join(_training(facts)),
        "\n".join(_results(facts.get("results") or {})),
        HOW_TO_LOAD,
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def write_model_card(directory: str | Path, results: dict[str, Any] | None = None) -> None:
    """Write `directory/README.md` for the converted model saved there, atomically;
    `results`: a run's measured numbers (metrics.json values) to add."""
    facts = folder_facts(directory)
    if results:
        facts["results"] = results
    write_text_atomic(Path(directory) / CARD, render_model_card(facts))
