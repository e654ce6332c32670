"""Run the recurformer command line in a child process that can be made to stop at a chosen
point, so that a test can interrupt it there (SIGINT, SIGKILL) and check what a re-run does.

    python tests/interrupt_driver.py [--hold WHERE] [--ready FILE] [--until STAGE] -- ARGS...

`--hold` makes the command write FILE and wait (for the test's signal) at WHERE:
  stage:NAME        after the `run` stage NAME did its work, before its marker is written
  checkpoint:STEP[:FOLDER]  after a training stage (into FOLDER, if given) saved its checkpoint of step STEP
  save:NAME         inside an atomic save of the directory NAME, its staging copy complete
`--until STAGE` runs `run`'s stages up to STAGE only (the report and metrics are not made).
Test code only: the hooks are patched in here, the library has none.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import recurformer.cli as cli
import recurformer.loading as loading
import recurformer.run as pipeline
from recurformer.run.layout import RunLayout
import recurformer.train.loop as loop


def holder(ready: Path):
    def hold() -> None:
        ready.write_text("ready")
        time.sleep(600)  # the test signals us here
        raise SystemExit("interrupt_driver: never signalled")
    return hold


def install(where: str, hold) -> None:
    kind, _, value = where.partition(":")
    if kind == "stage":
        finish = RunLayout.finish

        def finishing(layout, stage, record):
            if stage == value:
                hold()
            finish(layout, stage, record)
        RunLayout.finish = finishing
    elif kind == "checkpoint":
        save = loop._save_checkpoint
        step, _, folder = value.partition(":")

        def saving(accelerator, checkpoint, state):
            save(accelerator, checkpoint, state)
            if state["step"] == int(step) and folder in ("", checkpoint.parent.name):
                hold()
        loop._save_checkpoint = saving
    elif kind == "save":
        atomic_directory = loading.atomic_directory

        @contextmanager
        def held(path, replace=False):
            with atomic_directory(path, replace=replace) as staging:
                yield staging
                if Path(path).name == value:
                    hold()
        loading.atomic_directory = held
    else:
        raise SystemExit(f"interrupt_driver: unknown --hold {where!r}")


def limit_stages(until: str) -> None:
    names = [name for name, _, _ in pipeline.STAGES]
    stages = pipeline.STAGES[:names.index(until) + 1]
    run_pipeline = pipeline.run_pipeline

    def limited(config, out, force=False, progress=True):
        try:
            return run_pipeline(config, out, force=force, progress=progress, stages=stages)
        except FileNotFoundError as error:
            if Path(error.filename or "").name != "metrics.json":
                raise
            return collections.defaultdict(float)  # no report stage: nothing to print
    cli.run_pipeline = limited


def main() -> int:
    # Ctrl-C as a terminal delivers it, even when the tests run as a background job (whose
    # children start with SIGINT ignored, so Python would install no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold")
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--until")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.hold:
        install(options.hold, holder(options.ready))
    if options.until:
        limit_stages(options.until)
    return cli.main([a for a in options.args if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
