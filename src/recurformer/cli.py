"""Command line: a table from subcommand to function, no logic of its own.

The flags of each command are made from the fields of the config dataclasses its function
takes (`config.option` gives a field its help text): a default is defined once, in the
dataclass, and shown by `--help`. Every user-facing error is a `RecurformerError`, printed
as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from typing import Any

from . import __version__, commands
from .ablation import AblationConfig
from .bench import BenchConfig
from .config import ConfigError
from .dataset_ids import text_file
from .device import Placement
from .errors import RecurformerError
from .evaluate import TASKS
from .export import DEFAULT_TYPE, TYPES, export_command
from .hub import with_revision
from .mixers import MixerConfig
from .run import RunConfig, run_pipeline
from .scoring import SCORERS, AnalysisConfig, SelectionConfig
from .surgery import INITS
from .train import TrainConfig


class Parser(argparse.ArgumentParser):
    """argparse, its errors one line that names the flag once ("--context: must be >= 1"),
    without the usage block (`--help` shows it)."""

    def error(self, message: str) -> typing.NoReturn:
        found = re.match(r"argument ([^:]+): (.*)", message, flags=re.S)
        if found:
            flag, rest = found.groups()
            message = rest if rest.startswith(flag.split("/")[0]) else f"{flag}: {rest}"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises `RecurformerError` or `ValueError`."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except RecurformerError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        except ValueError as error:
            expected = {int: "an integer", float: "a number"}.get(parse)
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}" if expected else str(error)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _plain_type(hint: Any) -> Any:
    """`int | None` -> int; other hints as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _default(spec) -> Any:
    """The default `--help` shows: the field's `shown` text if it has one (a default that
    would fetch something to be known), else its value."""
    if "shown" in spec.metadata:
        return spec.metadata["shown"]
    if spec.default is not MISSING:
        return spec.default
    return spec.default_factory() if spec.default_factory is not MISSING else None


def add_options(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None,
                defaults: dict[str, Any] | None = None) -> list[str]:
    """Add a flag per field of the dataclass `cls` (or of the fields in `only`); returns the
    field names. The parsed value is None when the flag is not given, so the dataclass
    default applies (shown in the help, or `defaults[name]` when the help should show
    another text)."""
    hints = typing.get_type_hints(cls)
    names = []
    for spec in fields(cls):
        if only is not None and spec.name not in only:
            continue
        meta, hint = spec.metadata, _plain_type(hints[spec.name])
        flags = [meta.get("flag", "--" + spec.name.replace("_", "-")), *meta.get("aliases", ())]
        shown = (defaults or {}).get(spec.name, _default(spec))
        quiet = shown is None or shown is False or shown == [] or shown == ""
        text = meta.get("help", "") + ("" if quiet else f" (default: {_show(shown)})")
        text += "; a file, or a Hugging Face dataset id org/name:config:split" if spec.name in TEXT_FLAGS else ""
        text += f" (old name, kept for now: {', '.join(flags[1:])})" if len(flags) > 1 else ""
        kwargs: dict[str, Any] = dict(dest=spec.name, default=None, help=text)
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        if "choices" in meta:  # a function: the kinds are known once they have registered
            kwargs["choices"] = list(meta["choices"]())
        if hint is bool:
            kwargs.update(action="store_true", default=None)
        elif "parse" in meta:
            kwargs["type"] = _argument_type(meta["parse"])
        elif typing.get_origin(hint) is list:
            kwargs.update(nargs="+", type=typing.get_args(hint)[0])
        else:
            kwargs["type"] = _argument_type(hint)
        parser.add_argument(*flags, **kwargs)
        names.append(spec.name)
    return names


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if all(isinstance(v, (int, float)) for v in value) else " ".join(map(str, value))
    return str(value)


TEXT_FLAGS = ("data", "eval_data", "ood_data")  # take files or Hugging Face dataset ids


def _text_files(args: argparse.Namespace) -> None:
    """Each dataset id given to a text flag replaced by the local file of its text (`dataset_ids`)."""
    for name in TEXT_FLAGS:
        if isinstance(getattr(args, name, None), list):
            setattr(args, name, [text_file(spec) for spec in getattr(args, name)])


def build(cls: type, args: argparse.Namespace, **extra: Any):
    """`cls` from the parsed flags that were given (and `extra` values)."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
    return cls(**given, **extra)


def cmd_analyze(args: argparse.Namespace) -> int:
    analysis, selection = build(AnalysisConfig, args), build(SelectionConfig, args)
    scores = commands.analyze_command(with_revision(args.model, args.revision), args.data, args.out, plot=args.plot,
                                      analysis=analysis, selection=selection, ablation=build(AblationConfig, args),
                                      placement=build(Placement, args))
    values = [v for row in scores.groups[scores.metric] for v in row]
    print(f"scored {len(values)} KV groups on {scores.sequences} x {scores.seq_len} tokens; "
          f"{scores.metric}: min {min(values):.3f}, max {max(values):.3f}; wrote {args.out}")
    return 0


MIXER_FLAGS = ("window", "sinks", "ssd_state", "state_dtype")  # the MixerConfig fields `convert` takes as flags


def cmd_convert(args: argparse.Namespace) -> int:
    selection = build(SelectionConfig, args)
    mixer = MixerConfig.from_flags(args.kind or MixerConfig.kind, **{name: getattr(args, name) for name in MIXER_FLAGS})
    summary = commands.convert_command(with_revision(args.model, args.revision), args.scores, args.out,
                                       selection=selection, mixer=mixer, init=args.init, force=args.force)
    print(json.dumps(summary))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    config = commands.recipe_train_config(args.dir, given)
    summary = commands.train_command(args.dir, args.data, args.out, config, teacher=args.teacher,
                                     resume=args.resume, force=args.force, keep_checkpoint=args.keep_checkpoint)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    options = {name: getattr(args, name) for task in TASKS.values() for name in task.option_names()
               if getattr(args, name, None) is not None}
    print(json.dumps(commands.eval_command(with_revision(args.model, args.revision), args.task, args.out,
                                           placement=build(Placement, args), **options)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    result = commands.bench_command(args.dirs, args.out, build(BenchConfig, args),
                                    baseline=with_revision(args.baseline, args.revision), plot=args.plot)
    for ratio in result["ratios"]:
        print(json.dumps(ratio))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    options = build(commands.GenerationOptions, args)
    print(commands.generate_command(with_revision(args.model, args.revision), args.prompt, options,
                                    placement=build(Placement, args)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    print(json.dumps(export_command(with_revision(args.model, args.revision), args.out, args.type)))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.model_argument and args.model and args.model_argument != args.model:
        raise ConfigError(f"MODEL {args.model_argument!r} and --model {args.model!r} disagree; give one")
    args.model = with_revision(args.model_argument or args.model or RunConfig.model, args.revision)
    metrics = run_pipeline(build(RunConfig, args), args.out, force=args.force)
    print(f"wrote {args.out}/report.md and {args.out}/metrics.json: perplexity {metrics['ppl_original']:.2f} -> "
          f"{metrics['ppl_final']:.2f}, cache {metrics['cache_ratio']:.3f}x and decode {metrics['decode_speedup']:.2f}x "
          f"the original at {metrics['bench_context']} tokens")
    return 0


def _eval_options(parser: argparse.ArgumentParser) -> None:
    """One flag per option name of any task; the help says which tasks read it, with their defaults."""
    seen: dict[str, list[str]] = {}
    for task in TASKS.values():
        for spec in fields(task.options):
            default = _default(spec)
            if spec.name != task.argument and default is not None and default != []:
                seen.setdefault(spec.name, []).append(f"{task.name}: {_show(default)}")
    added: set[str] = set()
    for task in TASKS.values():
        fresh = [n for n in task.option_names() if n not in added and n != task.argument]
        add_options(parser, task.options, only=fresh, defaults={n: "; ".join(seen.get(n, [])) or None for n in fresh})
        added.update(fresh)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="recurformer",
        description="Replace recency-aware attention heads of a pretrained LLM with recurrent (or windowed) mixers.",
    )
    parser.add_argument("--version", action="version", version=f"recurformer {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    original_help = "the original model, as MODEL is given (default: the one the converted model records)"
    model_help = "local HF model directory, a known name (smollm2-135m) or a Hugging Face id org/name (docs/models.md)"
    revision_help = "of a Hugging Face id given as MODEL: branch, tag or commit (default: main)"

    p = subcommands.add_parser("analyze", help="score every head's recency ratio on real text")
    p.add_argument("model", help=model_help)
    p.add_argument("--revision", help=revision_help)
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help=".txt or .jsonl files, or Hugging Face "
                   "dataset ids org/name:config:split")
    p.add_argument("--out", required=True, help="scores JSON to write")
    p.add_argument("--plot", help="heatmap PNG to write (the groups --beta would replace marked)")
    add_options(p, AnalysisConfig)
    add_options(p, SelectionConfig)
    add_options(p, AblationConfig)
    add_options(p, Placement)
    p.set_defaults(func=cmd_analyze)

    p = subcommands.add_parser("convert", help="replace the top-beta KV groups by mixers and save the model")
    p.add_argument("model", help=model_help)
    p.add_argument("--revision", help=revision_help)
    p.add_argument("--scores", required=True, help="scores JSON written by 'analyze' on this model")
    add_options(p, SelectionConfig)
    add_options(p, MixerConfig, only=("kind", *MIXER_FLAGS))
    p.add_argument("--init", default=INITS[0], choices=INITS, help=f"how mixers start (default: {INITS[0]}: "
                   "from the replaced heads' weights; random: their own init)")
    p.add_argument("--out", required=True, help="directory to write the converted model into")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_convert)

    p = subcommands.add_parser("train", help="continual training of a converted model (transfer or lm stage)")
    p.add_argument("dir", help="converted model directory (from 'convert' or an earlier 'train')")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help="training text (.txt or .jsonl files, or "
                   "Hugging Face dataset ids org/name:config:split)")
    p.add_argument("--out", required=True, help="directory for the trained model, checkpoints and logs")
    add_options(p, TrainConfig, defaults={name: "the recipe of the model's mixer kind, as `run` trains it "
                                          "(docs/training.md)" for name in commands.RECIPE_FIELDS})
    p.add_argument("--original", "--teacher", dest="teacher", help=original_help + " (old name, kept for now: "
                   "--teacher)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--force", action="store_true", help="start over if --out exists")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the last checkpoint after training")
    p.set_defaults(func=cmd_train)

    p = subcommands.add_parser("eval", help="evaluate a model (converted or original)")
    p.add_argument("model", help="converted directory, or a model as for analyze (" + model_help + ")")
    p.add_argument("--revision", help=revision_help)
    tasks = ", ".join(t.name + (f":<{t.argument}>" if t.argument else "") for t in TASKS.values())
    p.add_argument("--task", required=True, help=f"one of {tasks} (docs/tasks.md)")
    p.add_argument("--out", help="metrics JSON to write")
    _eval_options(p)
    add_options(p, Placement)
    p.set_defaults(func=cmd_eval)

    p = subcommands.add_parser("bench", help="cache bytes, prefill and decode speed against the original model")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="converted model directories")
    p.add_argument("--original", "--baseline", dest="baseline", help=original_help + " (old name, kept for now: "
                   "--baseline)")
    p.add_argument("--revision", help="of a Hugging Face id given as --original: branch, tag or commit")
    add_options(p, BenchConfig)
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--plot", help="PNG to write")
    p.set_defaults(func=cmd_bench)

    p = subcommands.add_parser("generate", help="continue a prompt with a converted (or original) model")
    p.add_argument("model", help="converted directory, or a model as for analyze (" + model_help + ")")
    p.add_argument("--revision", help=revision_help)
    p.add_argument("--prompt", required=True, help="the text to continue")
    add_options(p, commands.GenerationOptions)
    add_options(p, Placement)
    p.set_defaults(func=cmd_generate)

    p = subcommands.add_parser("export", help="write a converted (or original) model as a GGUF file for llama.cpp")
    p.add_argument("model", help="converted directory, or a model as for analyze (" + model_help + ")")
    p.add_argument("--revision", help=revision_help)
    p.add_argument("--out", required=True, help="GGUF file to write (docs/engine.md)")
    p.add_argument("--type", default=DEFAULT_TYPE, choices=TYPES, help=f"tensor type (default: {DEFAULT_TYPE}; norms "
                   "and the tail's small tensors stay f32)")
    p.set_defaults(func=cmd_export)

    p = subcommands.add_parser("run", help="the whole method end to end: analyze, convert, train, evaluate, bench, report")
    p.add_argument("model_argument", nargs="?", metavar="MODEL", help=f"{model_help}; or --model (default: "
                   f"{RunConfig.model})")
    add_options(p, RunConfig)
    p.add_argument("--revision", help="of a Hugging Face id given as --model: branch, tag or commit (default: main)")
    p.add_argument("--out", required=True, help="run directory (re-running continues it)")
    p.add_argument("--force", action="store_true", help="start over in --out, deleting what is there")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _text_files(args)
        return int(args.func(args) or 0)
    except RecurformerError as error:
        print(f"recurformer: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        scorer = SCORERS.get(getattr(args, "scorer", None) or SelectionConfig.scorer)
        resumable = args.command == "run" or (args.command == "analyze" and scorer is not None and scorer.needs.ablation)
        hint = "; run the same command again to continue" if resumable else ""
        print(f"recurformer: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
