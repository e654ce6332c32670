"""Command line: a table from subcommand to function, no logic of its own.

Every command exits non-zero with a one-line error (no traceback) on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .config import ConfigError
from .data import DataError
from .hub import ModelResolutionError
from .modeling import UnsupportedArchitectureError
from .surgery import SurgeryError
from .train import TrainingDiverged

USER_ERRORS = (ConfigError, DataError, ModelResolutionError, UnsupportedArchitectureError, SurgeryError, TrainingDiverged)


def _floats(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _pair(convert, what: str, example: str):
    """An argparse type for `TRANSFER,LM`: two values read by `convert`."""
    def parse(text: str) -> tuple:
        try:
            transfer, lm = (convert(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected TRANSFER,LM {what} such as {example}, got {text!r}") from None
        return transfer, lm

    return parse


def cmd_analyze(args: argparse.Namespace) -> int:
    from .pipeline import analyze_command

    scores = analyze_command(
        args.model, args.data, args.out, plot=args.plot, window=args.window, sequences=args.sequences,
        seq_len=args.seq_len, batch_size=args.batch_size, beta=args.beta, scorer=args.scorer, seed=args.seed,
    )
    values = [v for row in scores.groups[scores.metric] for v in row]
    print(f"scored {len(values)} KV groups on {scores.sequences} x {scores.seq_len} tokens; "
          f"{scores.metric}: min {min(values):.3f}, max {max(values):.3f}; wrote {args.out}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .pipeline import convert_command

    summary = convert_command(
        args.model, args.scores, args.beta, args.out, mixer=args.mixer, scorer=args.scorer,
        init=args.init, seed=args.seed, force=args.force, window=args.window, sinks=args.sinks,
    )
    print(json.dumps(summary))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .pipeline import train_command
    from .train import TrainConfig

    config = TrainConfig(
        stage=args.stage, steps=args.steps, tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
        grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, clip=args.clip, trainable=args.trainable,
        distill_weight=args.distill_weight, distill_temperature=args.distill_temperature, lora_rank=args.lora_rank,
        precision=args.precision, checkpoint_every=args.checkpoint_every, seed=args.seed,
    )
    summary = train_command(args.dir, args.data, args.out, config, teacher=args.teacher, resume=args.resume,
                            force=args.force, keep_checkpoint=args.keep_checkpoint)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .pipeline import eval_task_command

    if args.task == "ppl":
        options = dict(data=args.data, context=args.context, stride=args.stride, max_tokens=args.max_tokens,
                       batch_size=args.batch_size)
    elif args.task == "hashhop":
        options = dict(num_problems=args.problems, hops=args.hops, target_tokens=args.context, seed=args.seed,
                       batch_size=args.batch_size)
    elif args.task == "mqar":
        options = dict(num_examples=args.problems, seq_len=args.context, num_kv_pairs=args.kv_pairs, seed=args.seed,
                       batch_size=args.batch_size)
    else:
        options = dict(limit=args.problems, batch_size=args.batch_size, include_path=args.lm_eval_include,
                       num_fewshot=args.fewshot) if args.task.startswith("lm-eval:") else {}
    options = {k: v for k, v in options.items() if v is not None}
    metrics = eval_task_command(args.model, args.task, args.out, **options)
    print(json.dumps(metrics))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .pipeline import bench_command, parse_contexts

    result = bench_command(args.dirs, parse_contexts(args.context), args.out, baseline=args.baseline,
                           decode_steps=args.decode_steps, budget_gib=args.budget_gib, plot=args.plot,
                           rounds=args.rounds)
    for ratio in result["ratios"]:
        print(json.dumps(ratio))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .pipeline import generate_command

    print(generate_command(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .run import RunConfig, default_corpora, run_pipeline

    train_files, eval_files = default_corpora()
    config = RunConfig(model=args.model, data=args.data or train_files, eval_data=args.eval_data or eval_files,
                       beta=args.beta, mixer=args.mixer, scorer=args.scorer, budget_minutes=args.budget_minutes,
                       steps=args.steps, lr=args.lr, quick=args.quick, seed=args.seed)
    metrics = run_pipeline(config, args.out, force=args.force)
    print(f"wrote {args.out}/report.md and {args.out}/metrics.json: perplexity {metrics['ppl_original']:.2f} -> "
          f"{metrics['ppl_final']:.2f}, cache {metrics['cache_ratio']:.3f}x and decode {metrics['decode_speedup']:.2f}x "
          f"the original at {metrics['bench_context']} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recurformer",
        description="Replace recency-aware attention heads of a pretrained LLM with recurrent (or windowed) mixers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("analyze", help="score every head's recency ratio on real text")
    p.add_argument("model", help="local HF model directory or a known name (smollm2-135m)")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help=".txt or .jsonl files")
    p.add_argument("--out", required=True, help="scores JSON to write")
    p.add_argument("--plot", help="heatmap PNG to write (replaced groups at --beta outlined)")
    p.add_argument("--window", type=int, default=16, help="recency window w (default 16)")
    p.add_argument("--sequences", type=int, default=32, help="number of sequences (default 32)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--beta", type=_floats, default=0.5, help="fraction of KV groups to outline in the plot")
    p.add_argument("--scorer", default="recency", help="recency | random | inverse (for the plot)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_analyze)

    p = commands.add_parser("convert", help="replace the top-beta KV groups by mixers and save the model")
    p.add_argument("model", help="local HF model directory or a known name (smollm2-135m)")
    p.add_argument("--scores", required=True, help="scores JSON written by 'analyze' on this model")
    p.add_argument("--beta", type=_floats, required=True, help="fraction of KV groups to replace, in [0, 1]")
    p.add_argument("--mixer", default="mamba", help="mamba (default) | mamba2 | window (docs/mixers.md)")
    p.add_argument("--window", type=int, help="window mixer: tokens each query attends back (default 64)")
    p.add_argument("--sinks", type=int, help="window mixer: first tokens always attended (default 4)")
    p.add_argument("--scorer", default="recency", help="recency | random | inverse")
    p.add_argument("--init", default="reuse", help="reuse (from the replaced heads) | random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory to write the converted model into")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_convert)

    p = commands.add_parser("train", help="continual training of a converted model (transfer or lm stage)")
    p.add_argument("dir", help="converted model directory (from 'convert' or an earlier 'train')")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help="training text (.txt or .jsonl)")
    p.add_argument("--stage", required=True, help="transfer | lm")
    p.add_argument("--out", required=True, help="directory for the trained model, checkpoints and logs")
    p.add_argument("--steps", type=int, help="optimizer steps (or give --tokens)")
    p.add_argument("--tokens", type=int, help="training tokens (or give --steps)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step over all processes")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=_floats, default=1e-3)
    p.add_argument("--warmup", type=_floats, default=0.05, help="fraction of the steps")
    p.add_argument("--clip", type=_floats, default=1.0)
    p.add_argument("--trainable", default="mixers", help="lm stage: mixers | mixers+lora | all")
    p.add_argument("--distill-weight", type=_floats, default=0.0, help="lm stage: weight of KL to the original")
    p.add_argument("--distill-temperature", type=_floats, default=1.0)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--teacher", help="the original model (default: the one recorded at conversion)")
    p.add_argument("--precision", default="auto", help="auto | no | bf16")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--force", action="store_true", help="start over if --out exists")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the last checkpoint after training")
    p.set_defaults(func=cmd_train)

    p = commands.add_parser("eval", help="evaluate a model (converted or original)")
    p.add_argument("model", help="converted directory, model directory or known name")
    p.add_argument("--task", required=True, help="ppl | hashhop | mqar | lm-eval:<task>")
    p.add_argument("--data", nargs="+", metavar="FILE", help="text to score (ppl)")
    p.add_argument("--out", help="metrics JSON to write")
    p.add_argument("--context", type=int, default=1024, help="ppl: tokens per window; hashhop/mqar: prompt tokens")
    p.add_argument("--problems", type=int, help="hashhop/mqar: number of problems; lm-eval: limit per task")
    p.add_argument("--hops", type=int, default=2, help="hashhop: hops per query")
    p.add_argument("--kv-pairs", type=int, default=32, help="mqar: key-value pairs per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stride", type=int, help="ppl: window step (default: --context, no overlap)")
    p.add_argument("--max-tokens", type=int, help="ppl: score only the first N tokens of the text")
    p.add_argument("--lm-eval-include", metavar="DIR", help="lm-eval: directory of extra task YAML files")
    p.add_argument("--fewshot", type=int, help="lm-eval: number of few-shot examples")
    p.add_argument("--batch-size", type=int, default=4)
    p.set_defaults(func=cmd_eval)

    p = commands.add_parser("bench", help="cache bytes, prefill and decode speed against the original model")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="converted model directories")
    p.add_argument("--baseline", help="the original model (default: the one DIR was converted from)")
    p.add_argument("--context", default="512,2048,8192", help="comma-separated context lengths")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (median reported)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every measurement; ratios are medians over rounds")
    p.add_argument("--budget-gib", type=_floats, default=1.0, help="cache budget for the max-context column")
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--plot", help="PNG to write")
    p.set_defaults(func=cmd_bench)

    p = commands.add_parser("generate", help="continue a prompt with a converted (or original) model")
    p.add_argument("model", help="converted model directory, model directory or known name")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=_floats, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = commands.add_parser("run", help="the whole method end to end: analyze, convert, train, evaluate, bench, report")
    p.add_argument("--model", default="smollm2-135m", help="local HF model directory or a known name")
    p.add_argument("--data", nargs="+", metavar="FILE", help="training text (default: the shared corpora, see docs/run.md)")
    p.add_argument("--eval-data", nargs="+", metavar="FILE", help="held-out text for perplexity")
    p.add_argument("--beta", type=_floats, default=0.5, help="fraction of KV groups to replace")
    p.add_argument("--mixer", default="mamba", help="mixer kind")
    p.add_argument("--scorer", default="recency", help="recency | inverse | random")
    p.add_argument("--budget-minutes", type=_floats, default=25.0, help="training time of both stages together")
    p.add_argument("--steps", type=_pair(int, "step counts", "40,16"), metavar="TRANSFER,LM",
                   help="train exactly these optimizer steps instead of --budget-minutes (equal-token comparisons)")
    p.add_argument("--lr", type=_pair(float, "learning rates", "5e-3,1e-3"), metavar="TRANSFER,LM", help="learning rates of the two stages (default 5e-3,1e-3; mamba2: 5e-3,2e-4)")
    p.add_argument("--quick", action="store_true", help="tiny sizes everywhere: a smoke test, numbers not meaningful")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="run directory (re-running continues it)")
    p.add_argument("--force", action="store_true", help="start over in --out, deleting what is there")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as error:
        print(f"recurformer: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = "; run the same command again to continue" if args.command == "run" else ""
        print(f"recurformer: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
