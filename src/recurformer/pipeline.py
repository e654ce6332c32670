"""The commands behind the CLI, as typed functions. Every input is checked before any long
work starts or any file is written; outputs are written atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import ConfigError, MixerConfig
from .data import check_length, load_documents, token_sequences, tokenize_documents
from .evaluate import hashhop_accuracy, mqar_accuracy, perplexity
from .files import write_json_atomic
from .hub import resolve_model
from .modeling import check_architecture
from .bench import compare
from .report import plot_bench, plot_head_heatmap
from .scoring import DEFAULT_WINDOWS, HeadScores, analyze, groups_to_replace, make_scorer, select_heads
from .surgery import INITS, convert, model_fingerprint, parameter_report
from .train import LMObjective, TrainConfig, TransferObjective, train
from .train.loop import CHECKPOINT


def load_model(name_or_path: str, progress: bool = True):
    """(model in fp32 eval mode, tokenizer, local directory) for a path or known name."""
    directory = resolve_model(name_or_path, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer, directory


def _portable_name(model: str) -> str:
    """A known name stays a name; a directory becomes its absolute path."""
    path = Path(model).expanduser()
    return str(path.resolve()) if (path / "config.json").is_file() else str(model)


def check_beta(beta: float) -> None:
    groups_to_replace(1, beta)  # raises the one-line error for a bad beta


def analyze_command(
    model: str,
    data: list[str],
    out: str,
    plot: str | None = None,
    window: int = 16,
    sequences: int = 32,
    seq_len: int = 1024,
    batch_size: int = 1,
    beta: float = 0.5,
    scorer: str = "recency",
    seed: int = 0,
) -> HeadScores:
    """Score every head of `model` on `sequences` x `seq_len` tokens of `data`."""
    if window < 1:
        raise ConfigError(f"--window must be >= 1, got {window}")
    check_beta(beta)
    chosen_scorer = make_scorer(scorer, seed)
    documents = load_documents(data)
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    check_length(seq_len, net.config)
    tokens = token_sequences(tokenizer, documents, seq_len, sequences, seed)
    scores = analyze(net, tokens, window=window, windows=DEFAULT_WINDOWS, batch_size=batch_size,
                     model_name=str(model), data=[str(p) for p in data])
    scores.fingerprint = model_fingerprint(net)
    scores.save(out)
    if plot:
        plot_head_heatmap(scores, plot, select_heads(scores, beta, chosen_scorer))
    return scores


def mixer_config_for(mixer: str, **options) -> MixerConfig:
    """The MixerConfig of `--mixer` with the flags given (None: not given); a flag that
    the kind does not read is an error rather than silently ignored."""
    given = {name: value for name, value in options.items() if value is not None}
    config = MixerConfig(kind=mixer, **given)
    window_only = sorted(set(given) & {"window", "sinks"})
    if window_only and mixer != "window":
        raise ConfigError(f"--{window_only[0]} applies to --mixer window, not --mixer {mixer}")
    return config


def convert_command(
    model: str,
    scores: str,
    beta: float,
    out: str,
    mixer: str = "mamba",
    scorer: str = "recency",
    init: str = "reuse",
    seed: int = 0,
    force: bool = False,
    window: int | None = None,
    sinks: int | None = None,
) -> dict:
    """Select the groups to replace, convert, and save the model + tokenizer into `out`.
    `window` and `sinks` size the window mixer (MixerConfig's defaults if None)."""
    check_beta(beta)
    if init not in INITS:
        raise ConfigError(f"--init: unknown {init!r}; choose one of {', '.join(INITS)}")
    mixer_config = mixer_config_for(mixer, window=window, sinks=sinks)
    chosen_scorer = make_scorer(scorer, seed)
    head_scores = HeadScores.load(scores)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"output directory {out_dir} exists and is not empty (use --force to replace it)")
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    shape = (net.config.num_hidden_layers, net.config.num_attention_heads, net.config.num_key_value_heads)
    if shape != (head_scores.num_layers, head_scores.num_heads, head_scores.num_kv_heads):
        raise ConfigError(
            f"scores are for a model with layers x heads x kv_heads = {head_scores.num_layers} x "
            f"{head_scores.num_heads} x {head_scores.num_kv_heads}, this model has {shape[0]} x {shape[1]} x {shape[2]}"
        )
    fingerprint = model_fingerprint(net)
    if head_scores.fingerprint and head_scores.fingerprint != fingerprint:
        raise ConfigError(
            f"scores were computed on another model ({head_scores.model}, fingerprint {head_scores.fingerprint}), "
            f"not on {model} (fingerprint {fingerprint})"
        )
    spec = select_heads(head_scores, beta, chosen_scorer)
    converted = convert(net, spec, mixer_config, init=init, seed=seed, source_model=_portable_name(model))
    report = parameter_report(net, converted)
    save_model_atomic(converted, tokenizer, out_dir)
    return {"groups": len(spec.groups), "fraction": spec.fraction, **report}


def save_model_atomic(model, tokenizer, out_dir: Path) -> None:
    """Save model + tokenizer into a hidden sibling directory, then swap it into place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_converted(directory: str):
    """(RecurFormer model, tokenizer) from a directory written by convert or train."""
    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{directory}: not a model directory (no config.json)")
    if json.loads(config_file.read_text()).get("model_type") != "recurformer":
        raise ConfigError(f"{directory}: not a converted RecurFormer model (run 'recurformer convert' first)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


def load_teacher(student, teacher: str | None):
    """The original model `student` was converted from, checked by its weight fingerprint."""
    name = teacher or student.config.source_model
    if not name:
        raise ConfigError("the model does not record the model it was converted from; pass --teacher")
    model, _, _ = load_model(name)
    expected = student.config.source_fingerprint
    if expected and model_fingerprint(model) != expected:
        raise ConfigError(f"teacher {name} is not the model this one was converted from (fingerprint mismatch)")
    return model


def train_command(
    directory: str,
    data: list[str],
    out: str,
    config: TrainConfig,
    teacher: str | None = None,
    resume: bool = False,
    force: bool = False,
    keep_checkpoint: bool = False,
) -> dict:
    """Run one training stage on a converted model and save the result into `out`."""
    out_dir = Path(out)
    has_checkpoint = (out_dir / CHECKPOINT).exists()
    if resume and not has_checkpoint:
        raise ConfigError(f"--resume: no checkpoint in {out_dir}")
    if not resume and out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise ConfigError(f"output directory {out_dir} exists and is not empty (use --resume to continue or --force to start over)")
        shutil.rmtree(out_dir)
    documents = load_documents(data)
    student, tokenizer = load_converted(directory)
    check_length(config.seq_len, student.config.text_config)
    needs_teacher = config.stage == "transfer" or config.distill_weight > 0
    original = load_teacher(student, teacher) if needs_teacher else None
    if config.stage == "transfer":
        objective = TransferObjective(original, student)
    else:
        objective = LMObjective(config.trainable, original, config.distill_weight, config.distill_temperature, config.lora_rank)
    sequences = token_sequences(tokenizer, documents, config.seq_len, seed=config.seed)
    summary = train(student, objective, sequences, config, out_dir, resume=resume)
    save_model_files(student, tokenizer, out_dir)
    if not keep_checkpoint:
        shutil.rmtree(out_dir / CHECKPOINT, ignore_errors=True)
    return summary


def save_model_files(model, tokenizer, out_dir: Path) -> None:
    """Save model + tokenizer into `out_dir` beside other files (logs), one atomic rename per file."""
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=".model-partial-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for item in staging.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_any(name_or_path: str):
    """(model, tokenizer) for a converted directory, a model directory or a known name."""
    config_file = Path(name_or_path) / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == "recurformer":
        return load_converted(name_or_path)
    model, tokenizer, _ = load_model(name_or_path)
    return model, tokenizer


def eval_ppl_command(
    model: str, data: list[str] | None, out: str | None = None, context: int = 1024, stride: int | None = None,
    max_tokens: int | None = None, batch_size: int = 4,
) -> dict:
    """Perplexity of `model` on the text of `data` (the first `max_tokens` tokens if given)."""
    if stride is not None and not 1 <= stride <= context:
        raise ConfigError(f"--stride must be in [1, --context], got {stride}")
    if max_tokens is not None and max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")
    if not data:
        raise ConfigError("--task ppl needs --data FILE")
    documents = load_documents(data)
    net, tokenizer = load_any(model)
    check_length(context, getattr(net.config, "text_config", net.config))
    ids = torch.tensor(tokenize_documents(tokenizer, documents))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    result = perplexity(net.eval(), ids, context=context, stride=stride, batch_size=batch_size)
    metrics = {"task": "ppl", "model": str(model), "data": [str(p) for p in data], **result.to_dict()}
    if out:
        write_json_atomic(out, metrics)
    return metrics


def parse_contexts(text: str) -> list[int]:
    try:
        contexts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--context: expected comma-separated integers, got {text!r}") from None
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"--context: expected positive integers, got {text!r}")
    return contexts


def bench_command(
    directories: list[str], contexts: list[int], out: str, baseline: str | None = None, decode_steps: int = 32,
    budget_gib: float = 1.0, plot: str | None = None,
) -> dict:
    """Cache, prefill, decode and memory of converted models against their original."""
    if decode_steps < 1:
        raise ConfigError(f"--decode-steps must be >= 1, got {decode_steps}")
    converted = {str(d): load_converted(d)[0].eval() for d in directories}
    first = next(iter(converted.values()))
    original = load_teacher(first, baseline)
    limit = first.config.text_config.max_position_embeddings
    if max(contexts) + decode_steps + 8 > limit:
        raise ConfigError(f"--context {max(contexts)} plus decoding exceeds the model's {limit} positions")
    contenders = {"original": (original.eval(), "dynamic"), "original+static-cache": (original, "static")}
    contenders.update({name: (model, "hybrid") for name, model in converted.items()})
    result = compare(contenders, ["original", "original+static-cache"], contexts, decode_steps,
                     budget_bytes=int(budget_gib * (1 << 30)), progress=lambda m: print(f"bench: {m}", flush=True))
    write_json_atomic(out, result)
    if plot:
        plot_bench(result, plot)
    return result


TASKS = ("ppl", "hashhop", "mqar", "lm-eval:<task>")


def eval_task_command(model: str, task: str, out: str | None = None, **options) -> dict:
    """Evaluate `model` (converted directory, model directory or known name) on `task`."""
    if task == "ppl":
        return eval_ppl_command(model, out=out, **options)
    if task not in ("hashhop", "mqar") and not task.startswith("lm-eval:"):
        raise ConfigError(f"--task: unknown {task!r}; choose one of {', '.join(TASKS)}")
    net, tokenizer = load_any(model)
    if task == "hashhop":
        metrics = hashhop_accuracy(net, tokenizer, **options)
    elif task == "mqar":
        metrics = mqar_accuracy(net, tokenizer, **options)
    else:
        from .lm_eval_adapter import run_lm_eval

        metrics = run_lm_eval(net, tokenizer, task.split(":", 1)[1], **options)
    metrics = {"model": str(model), **metrics}
    if out:
        write_json_atomic(out, metrics)
    return metrics


def generate_command(model: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0) -> str:
    """The continuation of `prompt` (greedy when `temperature` is 0, else sampled)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if not prompt:
        raise ConfigError("--prompt is empty")
    net, tokenizer = load_any(model)
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt")
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = net.eval().generate(**ids, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
