"""What the `ablation-joint` scorer selects (issue 44, a joint selection): the groups cheap on
both probes, from the text costs of `run`'s own analysis and the retrieval probe's costs,
against what `ablation` (text alone) and `ablation-retrieval` (retrieval alone) select at the
same beta. Per selection: how many groups it shares with the other two, and the sum of its
groups' single costs on each probe (each group windowed alone: `docs/analysis.md`; a
selection's real cost is not the sum, which only orders the selections). Writes
docs/results/joint-selection.json and, with `--merged`, a scores file holding both costs
that `recurformer run --scorer ablation-joint` trains from (copied into the run folder as
`scores.json`) without measuring either again.

    python -m benchmarks.retrieval.joint_selection --text runs/demo/scores.json \\
        --merged runs/joint-q/scores.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recurformer.errors import RecurformerError
from recurformer.files import write_json_atomic
from recurformer.scoring import HeadScores, make_scorer, select_heads

from benchmarks.common import RESULTS, ROOT

SCORERS = ("ablation", "ablation-retrieval", "ablation-joint")


def merged(text: HeadScores, retrieval: HeadScores) -> HeadScores:
    """`text` with the retrieval probe's `ablation_retrieval` costs beside its own."""
    if text.fingerprint != retrieval.fingerprint:
        raise SystemExit(f"error: the scores were made on different models ({text.fingerprint}, "
                         f"{retrieval.fingerprint})")
    for scores, statistic in ((text, "ablation"), (retrieval, "ablation_retrieval")):
        if statistic not in scores.groups:
            raise SystemExit(f"error: a scores file has no {statistic} costs")
    text.groups["ablation_retrieval"] = retrieval.groups["ablation_retrieval"]
    text.ablation = {**text.ablation, "probe": "text+retrieval",
                     "retrieval_base_nll": retrieval.ablation.get("base_nll"),
                     "seconds": text.ablation.get("seconds", 0) + retrieval.ablation.get("seconds", 0)}
    return text


def compare(scores: HeadScores, beta: float) -> dict:
    chosen = {name: set(select_heads(scores, beta, make_scorer(name)).groups) for name in SCORERS}
    costs = {statistic: scores.group_values(statistic) for statistic in ("ablation", "ablation_retrieval")}
    return {name: {"groups": len(groups),
                   "shared": {other: len(groups & chosen[other]) for other in SCORERS if other != name},
                   "text_cost": round(sum(costs["ablation"][g] for g in groups), 4),
                   "retrieval_cost": round(sum(costs["ablation_retrieval"][g] for g in groups), 4)}
            for name, groups in chosen.items()}


def portable(path: str) -> str:
    """`path` relative to the repository when it lies inside it (no machine's own paths in results)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="runs/demo/scores.json", help="scores with `ablation` costs (run's)")
    parser.add_argument("--retrieval", default=str(RESULTS / "smollm2-135m-ablation-retrieval-scores.json"))
    parser.add_argument("--betas", default="0.5,0.75")
    parser.add_argument("--merged", help="also write the scores with both costs here")
    parser.add_argument("--out", default=str(RESULTS / "joint-selection.json"))
    args = parser.parse_args()
    betas = args.betas.split(",")
    try:
        if not all(0 < float(beta) <= 1 for beta in betas):
            raise ValueError
    except ValueError:
        raise SystemExit(f"error: --betas takes fractions in (0, 1] separated by commas, not {args.betas!r}") from None
    try:
        scores = merged(HeadScores.load(args.text), HeadScores.load(args.retrieval))
    except (RecurformerError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    result = {"text": portable(args.text), "retrieval": portable(args.retrieval), "fingerprint": scores.fingerprint,
              "betas": {beta: compare(scores, float(beta)) for beta in betas}}
    write_json_atomic(Path(args.out), result)
    if args.merged:
        Path(args.merged).parent.mkdir(parents=True, exist_ok=True)
        scores.save(args.merged)
    print(json.dumps(result["betas"], indent=1))


if __name__ == "__main__":
    main()
