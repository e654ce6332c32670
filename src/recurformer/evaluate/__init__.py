"""Evaluation tasks behind `recurformer eval --task NAME` and the `evaluate` stage of `run`.

Each module of this package defines one task and registers it, other than `registry` and
the helpers the tasks share: `logits` (scoring every position), `generation` (greedy
answers), `conversation` (questions about one prefilled context) and `bootstrap` (intervals
over contexts). They are all imported here, so adding a task adds a module (with its test
and its doc) and touches nothing else. See docs/tasks.md.
"""

import importlib
import pkgutil

from .registry import TASKS, RunSettings, Task, lookup_task, make_options, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TASKS", "RunSettings", "Task", "lookup_task", "make_options", "register"]
