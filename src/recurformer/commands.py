"""The functions behind the subcommands (`analyze`, `convert`, `train`, `eval`, `bench`,
`generate`), typed, one per command. Each checks every input before any long work starts
or any file is written, then calls the library and writes its outputs atomically.
`analyze` and `convert` are the run's stages of the same names (`run/stages.py`);
`recurformer run` itself is `run.run_pipeline`."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench import BenchConfig, against_original
from .config import ConfigError, MixerConfig, option, require
from .data import DataError, check_length, load_documents, token_sequences
from .evaluate import lookup_task, make_options
from .files import write_json_atomic
from .loading import load_any, load_converted, load_model, load_teacher
from .modeling import check_architecture
from .report import plot_bench
from .ablation import AblationConfig
from .run import analyze_heads, convert_heads
from .scoring import AnalysisConfig, HeadScores, SelectionConfig
from .surgery import INITS
from .train import CHECKPOINT, TrainConfig, has_checkpoint, needs_teacher, train_stage


def _refuse_occupied(out: Path, hint: str) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output directory {out} exists and is not empty ({hint})")


def ablation_checkpoint(out: str | Path) -> Path:
    """Where `analyze --scorer ablation` (or `ablation-greedy`) keeps the groups scored so far, beside `out`."""
    out = Path(out)
    return out.with_name(out.name + ".ablation-partial.json")


def analyze_command(model: str, data: list[str], out: str, plot: str | None = None,
                    analysis: AnalysisConfig = AnalysisConfig(), selection: SelectionConfig = SelectionConfig(),
                    ablation: AblationConfig = AblationConfig()) -> HeadScores:
    """Score every head of `model` on `data`; write the scores (and the heatmap, with the
    groups `selection` would replace marked). With `--scorer ablation` (`ablation-greedy`), also
    each group's ablation cost (and the greedy order); an interrupted run resumes from the
    layers already in `ablation_checkpoint(out)`."""
    documents = load_documents(data)
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    return analyze_heads(net, tokenizer, documents, analysis, selection, ablation, str(model), [str(p) for p in data],
                         out, ablation_checkpoint(out), plot=plot)


def convert_command(model: str, scores: str, out: str, selection: SelectionConfig = SelectionConfig(),
                    mixer: MixerConfig | None = None, init: str = INITS[0], force: bool = False) -> dict:
    """Replace the groups `selection` picks from `scores` by `mixer`s (default: Mamba); save
    model + tokenizer into `out`. Returns the number of groups replaced and the parameter counts."""
    require(init in INITS, f"--init: unknown {init!r}; choose one of {', '.join(INITS)}")
    head_scores = HeadScores.load(scores)
    out_dir = Path(out)
    if not force:
        _refuse_occupied(out_dir, "use --force to replace it")
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    return convert_heads(net, tokenizer, head_scores, selection, mixer or MixerConfig(), init, str(model), out_dir)[1]


def train_command(directory: str, data: list[str], out: str, config: TrainConfig, teacher: str | None = None,
                  resume: bool = False, force: bool = False, keep_checkpoint: bool = False) -> dict:
    """Run one training stage on a converted model and save the result into `out`."""
    out_dir = Path(out)
    if resume and not has_checkpoint(out_dir):
        raise ConfigError(f"--resume: no checkpoint in {out_dir}")
    if not resume and out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            _refuse_occupied(out_dir, "use --resume to continue or --force to start over")
        shutil.rmtree(out_dir)
    documents = load_documents(data)
    student, tokenizer = load_converted(directory)
    check_length(config.seq_len, student.config.text_config)
    original = load_teacher(student, teacher) if needs_teacher(config) else None
    sequences = token_sequences(tokenizer, documents, config.seq_len, seed=config.seed)
    summary = train_stage(student, tokenizer, original, sequences, config, out_dir, resume=resume)
    if not keep_checkpoint:
        shutil.rmtree(out_dir / CHECKPOINT, ignore_errors=True)
    return summary


def eval_command(model: str, task: str, out: str | None = None, **options) -> dict:
    """Evaluate `model` (converted directory, model directory or known name) on `task`
    (`name` or `name:argument`, see `recurformer.evaluate`); `options` are the task's
    options (None: the task's default)."""
    chosen, argument = lookup_task(task)
    settings = make_options(chosen, {**options, **argument})
    missing = [path for path in getattr(settings, "data", []) if not Path(path).is_file()]
    if missing:  # before the model loads, not after
        raise DataError(f"data file not found: {missing[0]}")
    net, tokenizer = load_any(model)
    metrics = {"model": str(model), "task": chosen.name, **chosen.measure(net.eval(), tokenizer, settings)}
    if out:
        write_json_atomic(out, metrics)
    return metrics


def bench_command(directories: list[str], out: str, config: BenchConfig = BenchConfig(), baseline: str | None = None,
                  plot: str | None = None) -> dict:
    """Cache, prefill, decode and memory of converted models against their original, all
    loaded in `config.dtype`."""
    converted = {str(d): load_converted(d, dtype=config.torch_dtype)[0] for d in directories}
    original = load_teacher(next(iter(converted.values())), baseline, dtype=config.torch_dtype)
    result = against_original(converted, original, config, progress=lambda m: print(f"bench: {m}", flush=True))
    write_json_atomic(out, result)
    if plot:
        plot_bench(result, plot)
    return result


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = option(64, "tokens to generate")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    seed: int = option(0, "seeds the sampling")

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        require(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")


def generate_command(model: str, prompt: str, options: GenerationOptions = GenerationOptions()) -> str:
    """The continuation of `prompt` (greedy when the temperature is 0, else sampled)."""
    require(bool(prompt), "--prompt is empty")
    net, tokenizer = load_any(model)
    torch.manual_seed(options.seed)
    ids = tokenizer(prompt, return_tensors="pt")
    sampling = dict(do_sample=True, temperature=options.temperature) if options.temperature > 0 else dict(do_sample=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generated = net.eval().generate(**ids, max_new_tokens=options.max_new_tokens, pad_token_id=pad, **sampling)
    return tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
