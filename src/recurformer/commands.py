"""The functions behind the subcommands (`analyze`, `convert`, `train`, `eval`, `bench`,
`generate`), typed, one per command. Each checks every input before any long work starts
or any file is written (its `check_*` function: what its arguments, the model's config and
the texts' lengths show, before any weight is loaded), then calls the library and writes its
outputs atomically.
`analyze` and `convert` are the run's stages of the same names (`run/stages.py`);
`recurformer run` itself is `run.run_pipeline`."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from .ablation import AblationConfig, check_ablation, check_calibration_text
from .attention import check_window_fits
from .bench import BenchConfig, against_original, check_contexts
from .checks import read_json_object, require_finite
from .config import option, require
from .device import Placement
from .data import check_length, check_sequences, load_documents, not_found, token_sequences
from .decode_graph import generate_tokens
from .evaluate import lookup_task, make_options
from .files import sweep_staging, write_json_atomic
from .hub import model_path
from .loading import (CPU, check_converted, check_convertible, load_any, load_converted, load_model, load_teacher,
                      model_bytes, model_config, model_tokenizer)
from .mixers import MixerConfig
from .modeling import check_architecture
from .outputs import check_output, check_replaceable, claim_folder, size_of
from .mixers import MIXERS
from .recipe import RECIPES, STAGES, micro_batches
from .report import plot_bench
from .run import analyze_heads, convert_heads
from .scoring import AnalysisConfig, HeadScores, SelectionConfig
from .surgery import INITS
from .train import CHECKPOINT, TrainConfig, check_checkpoint, made_by_train, needs_teacher, train_stage

SMALL_OUTPUT_BYTES = 64 * 2**20  # room for a scores or metrics JSON and a plot
# [ours] room for what convert and train write, in copies of the original model's weights: the
# converted model (~1.1x; an older one is kept until the new one is complete), and for train the
# model, its checkpoint and the checkpoint being written
CONVERT_MODEL_COPIES, TRAIN_MODEL_COPIES = 1.25, 4


def ablation_checkpoint(out: str | Path) -> Path:
    """Where `analyze --scorer ablation` (or `ablation-greedy`) keeps the groups scored so far, beside `out`."""
    out = Path(out)
    return out.with_name(out.name + ".ablation-partial.json")


def analyze_command(model: str, data: list[str], out: str, plot: str | None = None,
                    analysis: AnalysisConfig = AnalysisConfig(), selection: SelectionConfig = SelectionConfig(),
                    ablation: AblationConfig = AblationConfig(), placement: Placement = CPU) -> HeadScores:
    """Score every head of `model` on `data`; write the scores (and the heatmap, with the
    groups `selection` would replace marked). With `--scorer ablation` (`ablation-greedy`), also
    each group's ablation cost (and the greedy order); an interrupted run resumes from the
    layers already in `ablation_checkpoint(out)`."""
    check_convertible(model)
    inputs = [model_path(model), *data]
    check_output(out, inputs, SMALL_OUTPUT_BYTES, folder=False)
    if plot:
        check_output(plot, inputs, folder=False, flag="--plot")
    check_analyze(model, data, analysis, selection, ablation)
    sweep_staging(Path(out).parent)  # temporary files of an analyze that was killed
    documents = load_documents(data)
    net, tokenizer, _ = load_model(model, dtype=placement.torch_dtype, device=placement.torch_device)
    check_architecture(net.config)
    return analyze_heads(net, tokenizer, documents, analysis, selection, ablation, str(model), [str(p) for p in data],
                         out, ablation_checkpoint(out), plot=plot)


def check_analyze(model: str, data: list[str], analysis: AnalysisConfig, selection: SelectionConfig,
                  ablation: AblationConfig) -> None:
    """What `analyze` would refuse, from the model's config and the text's length (counted no
    further than the sequences need), before any weight is loaded: an architecture we cannot
    convert, sequences beyond the model's positions, the ablation the scorer needs beyond them
    (or its sliding window, or with more rounds than KV groups), too little text."""
    documents = load_documents(data)  # the files are there (read when counted)
    config = model_config(model)
    check_architecture(config)
    check_length(analysis.seq_len, config)
    measured = selection.needs.measurement(ablation)
    if measured is not None:
        check_ablation(measured, config)
    tokenizer = model_tokenizer(model, config)
    check_sequences(tokenizer, documents, analysis.seq_len, analysis.sequences)
    if measured is not None:
        check_calibration_text(tokenizer, documents, measured)


def convert_command(model: str, scores: str, out: str, selection: SelectionConfig = SelectionConfig(),
                    mixer: MixerConfig | None = None, init: str = INITS[0], force: bool = False) -> dict:
    """Replace the groups `selection` picks from `scores` by `mixer`s (default: Mamba); save
    model + tokenizer into `out`. Returns the number of groups replaced and the parameter counts."""
    require(init in INITS, f"--init: unknown {init!r}; choose one of {', '.join(INITS)}")
    check_convertible(model)
    out_dir = Path(out)
    check_output(out_dir, [model_path(model), scores], int(CONVERT_MODEL_COPIES * model_bytes(model)), replaced=True,
                 beside=True)
    check_replaceable(out_dir, "convert", force)
    head_scores = HeadScores.load(scores)
    check_convert(model, head_scores, selection, mixer or MixerConfig())
    sweep_staging(out_dir.parent)  # what a convert that was killed while saving left
    net, tokenizer, _ = load_model(model)
    check_architecture(net.config)
    return convert_heads(net, tokenizer, head_scores, selection, mixer or MixerConfig(), init, str(model), out_dir,
                         command="convert")[1]


def check_convert(model: str, scores: HeadScores, selection: SelectionConfig, mixer: MixerConfig) -> None:
    """What `convert` would refuse, from the model's config, before any weight is loaded: an
    architecture we cannot convert, scores of a model of another shape or without what the
    scorer ranks by, a window beyond the model's positions."""
    config = model_config(model)
    check_architecture(config)
    scores.check_shape(config, str(model))
    selection.select(scores)
    check_window_fits(config, mixer)


RECIPE_FIELDS = ("seq_len", "batch_size", "grad_accum", "lr", "trainable", "distill_weight", "ce_weight")  # train's flags a recipe sets


def recipe_train_config(directory: str, given: dict) -> TrainConfig:
    """[ours] `train`'s configuration: the flags `given`, and for the others the recipe `run` trains
    the folder's mixer kind with (`recipe.py`: what trains, the loss, sequence length, batch,
    learning rate of the stage), so that `train` trains as `run` does."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise not_found(str(config_file))
    kind = read_json_object(config_file, "config").get("mixer", {}).get("kind")
    stage = given.get("stage") or TrainConfig.stage
    name = MIXERS[kind].recipe if kind in MIXERS else None
    recipe = {}
    if name is not None and stage in STAGES:  # otherwise TrainConfig, load_converted or training say what is wrong
        planned = RECIPES[name].stage(stage).train_config(stage, steps=1, seed=0)
        recipe = {field: getattr(planned, field) for field in RECIPE_FIELDS}
    merged = {**recipe, **given}
    if recipe and "grad_accum" not in given:  # the recipe's micro-batches, for the batch and length in force
        merged["grad_accum"] = micro_batches(merged["batch_size"], merged["seq_len"])
    return TrainConfig(**merged)


def train_command(directory: str, data: list[str], out: str, config: TrainConfig, teacher: str | None = None,
                  resume: bool = False, force: bool = False, keep_checkpoint: bool = False) -> dict:
    """Run one training stage on a converted model and save the result into `out`."""
    out_dir = Path(out)
    inputs = [directory, *data, *([model_path(teacher)] if teacher else [])]
    check_output(out_dir, inputs, TRAIN_MODEL_COPIES * model_bytes(directory) - (size_of(out_dir) if resume else 0),
                 replaced=force and not resume)
    if resume:
        check_checkpoint(out_dir / CHECKPOINT)
    check_train(directory, data, config)
    # locked while training: a second train into the same --out is refused
    with claim_folder(out_dir, "train", keep=resume, replace=force and not resume, ours=made_by_train(out_dir),
                      hint="use --resume to continue or --force to start over"):
        documents = load_documents(data)
        student, tokenizer = load_converted(directory)
        check_length(config.seq_len, student.config.text_config)
        original = load_teacher(student, teacher) if needs_teacher(config) else None
        sequences = token_sequences(tokenizer, documents, config.seq_len, seed=config.seed)
        summary = train_stage(student, tokenizer, original, sequences, config, out_dir, resume=resume)
        if not keep_checkpoint:
            shutil.rmtree(out_dir / CHECKPOINT, ignore_errors=True)
    return summary


def check_train(directory: str, data: list[str], config: TrainConfig) -> None:
    """What `train` would refuse, from the folder's config and the text's length (counted no
    further than one sequence), before any weight is loaded: a folder that is not a converted
    model, sequences beyond its positions, too little text for one sequence."""
    documents = load_documents(data)  # the files are there (read when counted)
    check_converted(directory)
    model = model_config(directory)
    check_length(config.seq_len, model.get_text_config())
    check_sequences(model_tokenizer(directory, model), documents, config.seq_len)


def eval_command(model: str, task: str, out: str | None = None, placement: Placement = CPU, **options) -> dict:
    """Evaluate `model` (converted directory, model directory or known name) on `task`
    (`name` or `name:argument`, see `recurformer.evaluate`) where `placement` puts it;
    `options` are the task's options (None: the task's default)."""
    chosen, argument = lookup_task(task)
    settings = make_options(chosen, {**options, **argument})
    missing = [path for path in getattr(settings, "data", []) if not Path(path).is_file()]
    if missing:  # before the model loads, not after
        raise not_found(missing[0])
    if out:
        check_output(out, [model_path(model), *getattr(settings, "data", [])], SMALL_OUTPUT_BYTES, folder=False)
    config = model_config(model)  # the task's checks, before any weight is loaded (`Task.check`)
    chosen.preflight(settings, config, cache(lambda: model_tokenizer(model, config)))
    net, tokenizer = load_any(model, placement)
    metrics = {"model": str(model), "task": chosen.name, **chosen.measure(net.eval(), tokenizer, settings)}
    require_finite(metrics, f"--task {chosen.name} on {model}")  # never a NaN written as a result
    if out:
        write_json_atomic(out, metrics)
    return metrics


def bench_command(directories: list[str], out: str, config: BenchConfig = BenchConfig(), baseline: str | None = None,
                  plot: str | None = None) -> dict:
    """Cache, prefill, decode and memory of converted models against their original, all
    loaded in `config.dtype`."""
    check_output(out, directories, SMALL_OUTPUT_BYTES, folder=False)
    if plot:
        check_output(plot, directories, folder=False, flag="--plot")
    for directory in directories:  # before any weight is loaded
        check_converted(directory)
        check_contexts(config, model_config(directory).get_text_config())
    converted = {str(d): load_converted(d, config.torch_dtype, config.torch_device)[0] for d in directories}
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


def generate_command(model: str, prompt: str, options: GenerationOptions = GenerationOptions(),
                     placement: Placement = CPU) -> str:
    """The continuation of `prompt` (greedy when the temperature is 0, else sampled;
    `generate_tokens`: a RecurFormer model on a GPU decodes with its steps replayed from a
    CUDA graph, docs/gpu.md)."""
    require(bool(prompt), "--prompt is empty")
    net, tokenizer = load_any(model, placement)
    torch.manual_seed(options.seed)
    ids = tokenizer(prompt, return_tensors="pt").to(net.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generated = generate_tokens(net.eval(), ids["input_ids"], options.max_new_tokens, pad, options.temperature,
                                ids.get("attention_mask"))
    return tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
