"""The shape of the package, checked on its source with `ast`: imports flow one way, from
the edge (cli) to the core (ops); no private name crosses a module boundary; imports sit at
module top except optional dependencies; every third-party package imported is declared.
docs/architecture.md describes the layers."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

from recurformer.data import EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA, TRAIN_CORPORA

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "recurformer"

# Bottom to top. A module may import modules of its own layer or of lower ones, never of a
# higher one. Layer 0 holds the leaves that anything may use.
LAYERS: dict[str, int] = {
    "errors": 0, "config": 0, "device": 0, "files": 0, "data": 0, "retrieval_mix": 0, "dataset_ids": 0, "corpus_sources": 0, "tasks": 0, "hub": 0, "memory": 0, "checks": 0, "outputs": 0,
    "ops": 1, "kv_quant": 1,
    "mixers": 2,
    "attention": 3, "attention_hook": 3, "cache": 3,
    "modeling": 4, "surgery": 4, "decode_graph": 4, "stored_kv": 4,
    "loading": 5, "model_card": 5, "metrics": 5, "ablation": 5, "retrieval_probe": 5, "equal_cache": 5, "eviction": 5, "scoring": 5,
    "train": 5,
    "evaluate": 5, "bench": 5, "recipe": 5, "export": 5,
    "report": 6,
    "run": 7,
    "commands": 8,
    "cli": 9,
    "__init__": 10,  # the public API re-exports from every layer
}
# Optional dependencies, imported inside the function that needs them (with the reason beside it).
OPTIONAL = {"peft", "lm_eval", "mamba_ssm", "causal_conv1d", "fla", "datasets"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def benchmark_scripts() -> list[Path]:
    """Every script under benchmarks/, in its room or not."""
    return sorted((ROOT / "benchmarks").rglob("*.py"))


def unit(path: Path) -> str:
    """The layer unit a file belongs to: its top-level module or package under recurformer."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported_units(path: Path, node: ast.ImportFrom | ast.Import) -> list[tuple[str, list[str]]]:
    """(recurformer unit, imported names) of an import statement; empty for other packages."""
    if isinstance(node, ast.Import):
        return [(a.name.split(".")[1], []) for a in node.names if a.name.startswith("recurformer.")]
    if node.level == 0:
        if not (node.module or "").startswith("recurformer"):
            return []
        parts = node.module.split(".")[1:]
    else:
        here = list(path.relative_to(PACKAGE).with_suffix("").parts[:-1])
        base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        parts = base + (node.module.split(".") if node.module else [])
    names = [a.name for a in node.names]
    if not parts:  # `from . import x` at the package root
        return [(name, []) for name in names]
    return [(parts[0], names)]


def test_every_module_has_a_layer():
    missing = sorted({unit(p) for p in modules()} - set(LAYERS))
    assert not missing, f"give these modules a layer in tests/test_architecture.py: {missing}"


def test_imports_never_go_up_a_layer():
    wrong = []
    for path in modules():
        mine = unit(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, _ in imported_units(path, node):
                    if target != mine and LAYERS.get(target, -1) > LAYERS[mine]:
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {mine} (layer {LAYERS[mine]}) imports "
                                     f"{target} (layer {LAYERS[target]})")
    assert not wrong, "imports that go up a layer:\n" + "\n".join(wrong)


def test_no_private_name_is_imported_from_another_module():
    wrong = []
    for path in [*modules(), *benchmark_scripts()]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level + (node.module or "").startswith("recurformer") > 0:
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                if private:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {', '.join(private)}")
    assert not wrong, "\n".join(wrong)


def test_imports_sit_at_module_top_except_optional_dependencies():
    wrong = []
    for path in modules():
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        roots = {a.name.split(".")[0] for a in node.names}
                    elif isinstance(node, ast.ImportFrom):
                        roots = {(node.module or "").split(".")[0]} if node.level == 0 else {"recurformer"}
                    else:
                        continue
                    if not roots <= OPTIONAL:
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "imports inside functions (move them to the module top):\n" + "\n".join(wrong)


def test_only_attention_hook_registers_attention_functions():
    """Running a model's attention through a function of ours is `attention_hook`'s job alone:
    no other module registers a function with transformers' attention registry."""
    wrong = []
    for path in modules():
        if path.name == "attention_hook.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            registers = (isinstance(node, ast.Name) and node.id == "AttentionInterface") or (
                isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del))
                and ast.unparse(node.value) == "ALL_ATTENTION_FUNCTIONS")
            if registers:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "use attention_hook.attention_hook instead:\n" + "\n".join(wrong)


def declared_packages() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {normalize(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Optional packages whose distribution is not named as they are imported, for machines without them.
NOT_NAMED_AS_IMPORTED = {"fla": ["flash-linear-attention"]}


def test_every_third_party_package_imported_is_declared():
    distributions = importlib.metadata.packages_distributions()
    declared, missing = declared_packages(), set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root in sys.stdlib_module_names or root == "recurformer":
                    continue
                names = {normalize(d) for d in distributions.get(root, NOT_NAMED_AS_IMPORTED.get(root, [root]))}
                if not names & declared:
                    missing.add(f"{root} (imported in {path.relative_to(ROOT)})")
    assert not missing, f"declare these in pyproject.toml: {sorted(missing)}"


@pytest.mark.parametrize("source, expected", [
    ("from ..config import option", [("config", ["option"])]),
    ("from .registry import Task", [("evaluate", ["Task"])]),
    ("from . import commands", [("commands", [])]),
    ("import recurformer.pipeline", [("pipeline", [])]),
    ("from torch import nn", []),
])
def test_the_import_reader_resolves_relative_imports(source, expected):
    where = PACKAGE / ("evaluate/hashhop.py" if "registry" in source else "train/loop.py" if ".." in source else "cli.py")
    assert imported_units(where, ast.parse(source).body[0]) == expected


def test_every_benchmark_script_is_listed_in_its_room():
    """docs/benchmarks.md names every script of benchmarks/<room>/ under that room's heading."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rooms = re.split(r"\n\*\*`(\w+)/`\*\*", text)[1:]  # [room, its text, room, its text, ...]
    listed = {room: set(re.findall(r"^\| `(\w+)\.py` \|", body, re.M)) for room, body in zip(rooms[::2], rooms[1::2])}
    for folder in sorted(p for p in (ROOT / "benchmarks").iterdir() if p.is_dir() and p.name != "__pycache__"):
        scripts = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        assert scripts == listed.get(folder.name, set()), f"docs/benchmarks.md, room {folder.name}/"


def test_benchmark_scripts_find_paths_and_corpora_through_the_shared_helper():
    """Only benchmarks/common.py (and kvpress's script, which runs without recurformer) locates
    the repository; no script spells a corpus file the library names."""
    for path in benchmark_scripts():
        if path.name in ("common.py", "kvpress_eval.py"):
            continue
        source = path.read_text()
        assert "Path(__file__)" not in source, f"{path.relative_to(ROOT)} locates the repository itself"
        for corpus in ("wikitext-2-valid.txt", "wikitext-2-raw-test.txt", "lee-background-news.txt"):
            assert corpus not in source, f"{path.relative_to(ROOT)} spells {corpus}; use benchmarks.common"


def test_tests_find_the_corpora_as_the_package_does():
    """A test that reads a shared corpus finds it through `recurformer.data` (`$RECURFORMER_DATA`,
    else ../shared/data), never by a path or a file name of its own."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        source = path.read_text()
        for spelled in ("shared/data", '"shared" / "data"', *TRAIN_CORPORA, *EVAL_CORPORA, *OUT_OF_DOMAIN_CORPORA):
            assert spelled not in source, f"{path.relative_to(ROOT)} spells {spelled}; use recurformer.corpus_sources.shared_corpora"
