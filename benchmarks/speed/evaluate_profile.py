"""Where `run`'s evaluate stage spends its time (issue 65), on a finished run's models.

Times every evaluation the stage runs (`recurformer.run.stages.evaluate`: each task with its
run options, on each model it is run on, in the stage's order), then measures the one saving the
profile offers, in the same process: `agreement` compares the final model and the window baseline
with the same original on the same windows, and keeps the original's states from the first for
the second (`recurformer.evaluate.agreement.reference_hidden`). It is timed with the states kept
and with them dropped before each model, in turn (`--repeats` pairs), and the two results are
checked equal.

Writes docs/results/evaluate-profile.json and .md.

    python -m benchmarks.speed.evaluate_profile runs/demo [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recurformer.evaluate import lookup_task
from recurformer.evaluate.agreement import drop_reference_states
from recurformer.files import write_json_atomic, write_text_atomic
from recurformer.memory import release_freed_memory
from recurformer.run.config import RunConfig
from recurformer.run.stages import BASELINE, MODELS, Run, evaluated_model, run_tasks

from benchmarks.common import RESULTS


def profile_stage(run: Run) -> list[dict]:
    """Seconds of each (evaluation, model) of the stage, in its order."""
    settings, rows = run.task_settings(), []
    for name in (*MODELS, BASELINE):
        model = evaluated_model(run, name).eval()
        for task in run_tasks():
            for key, options in task.run_options(settings).items():
                if name in task.models_for(key):
                    start = time.perf_counter()
                    task.measure(model, run.tokenizer, options, original=run.original)
                    rows.append({"evaluation": key, "model": name, "seconds": time.perf_counter() - start})
                    print(f"{key:>16} {name:>9} {rows[-1]['seconds']:6.1f} s", flush=True)
        del model
        release_freed_memory()
    return rows


def agreement_reuse(run: Run, repeats: int) -> dict:
    """The agreement of the final model and the baseline, the original's states kept between
    them against dropped before each, `repeats` times each, alternating."""
    task = lookup_task("agreement")[0]
    options = task.run_options(run.task_settings())["agreement"]
    models = {name: evaluated_model(run, name).eval() for name in ("final", BASELINE)}
    seconds, results = {"kept": [], "dropped": []}, {}
    for _ in range(repeats):
        for mode in ("dropped", "kept"):
            drop_reference_states()
            start, out = time.perf_counter(), []
            for name, model in models.items():
                if mode == "dropped":
                    drop_reference_states()
                out.append(task.measure(model, run.tokenizer, options, original=run.original))
            seconds[mode].append(time.perf_counter() - start)
            results[mode] = out
    same = results["kept"] == results["dropped"]
    kept, dropped = statistics.median(seconds["kept"]), statistics.median(seconds["dropped"])
    return {"seconds": seconds, "kept_s": kept, "dropped_s": dropped, "ratio": kept / dropped, "same_results": same}


def markdown(record: dict) -> str:
    rows, total = record["stage"], sum(r["seconds"] for r in record["stage"])
    by_task: dict[str, float] = {}
    for r in rows:
        by_task[r["evaluation"]] = by_task.get(r["evaluation"], 0.0) + r["seconds"]
    lines = ["# Where `run`'s evaluate stage spends its time (SmolLM2-135M, the default run)", "",
             f"`benchmarks/speed/evaluate_profile.py` on `{record['run']}`, {record['threads']} threads: every "
             f"evaluation of the stage on each model it runs on, **{total / 60:.1f} minutes** in all.", "",
             "| evaluation | " + " | ".join(m for m in (*MODELS, BASELINE)) + " | all | share |",
             "|---|" + "---|" * (len(MODELS) + 3)]
    for key, seconds in by_task.items():
        cells = []
        for name in (*MODELS, BASELINE):
            found = [r["seconds"] for r in rows if r["evaluation"] == key and r["model"] == name]
            cells.append(f"{found[0]:.1f}" if found else "")
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {seconds:.1f} | {seconds / total:.0%} |")
    reuse = record["agreement_reuse"]
    lines += ["", "Seconds. Every pass reads a text or a model no other pass reads, except one: `agreement` compares "
              "the final model and the window baseline with the same original on the same windows. The passes are "
              "forward passes at this machine's matrix-product rate (`analyze-profile.md`: the same layers run at "
              "it there), RULER's mostly its 12 prefills of 4,096 tokens on each model; the perplexities of the "
              "untrained and transfer models are rows of the report's recovery table. Skipping or batching any of "
              "them would change a result or leave the work the same.",
              "", f"**The saving taken**: the original's states on those windows kept from the final model's "
              f"comparison for the baseline's (`evaluate.agreement.reference_hidden`): the two comparisons in "
              f"{reuse['kept_s']:.1f} s against {reuse['dropped_s']:.1f} s (**{reuse['ratio']:.2f}x**, median of "
              f"{len(reuse['seconds']['kept'])} alternating pairs), results "
              f"{'identical' if reuse['same_results'] else 'DIFFERENT'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a finished run folder of the default configuration (make demo's runs/demo)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    run = Run(RunConfig(), args.run)
    missing = [name for name in MODELS if name != "original" and not run.layout.model(name).is_dir()]
    if missing:  # before the original's evaluations, which take minutes
        raise SystemExit(f"evaluate_profile: {args.run} is not a finished run: no {', '.join(missing)} model folder")
    record = {"run": args.run, "threads": torch.get_num_threads(), "stage": profile_stage(run),
              "agreement_reuse": agreement_reuse(run, args.repeats)}
    write_json_atomic(RESULTS / "evaluate-profile.json", record)
    write_text_atomic(RESULTS / "evaluate-profile.md", markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
