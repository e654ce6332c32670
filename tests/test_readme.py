"""The README's numbers are the numbers of the files it cites: each row of its two tables is
rebuilt here from the JSON named in the row's source column. And the docs hold: every file
they name exists, every table row is as wide as its header, no machine's own paths, the
example run's figures in docs/mixers.md are its metrics, the license file is the declared one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny_models import save_tiny_model, spec_for, tiny_model

from recurformer import convert
from recurformer.cli import main
from recurformer.config import SUPPORTED_ARCHITECTURES
from recurformer.metrics import Metric, Row, render_rows

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RUN = "docs/results/example-run/metrics.json"
BENCH = "docs/results/bench.json"


def table_rows(heading: str) -> dict[str, list[str]]:
    """The rows of the first table after the line starting with `heading`: first cell -> cells."""
    lines = README[README.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def quality_rows(m: dict) -> dict[str, list[str]]:
    """measure -> (original, converted, window at equal bytes) as the README shows them."""
    def ppl(key: str) -> list[str]:
        o, f, b = m[f"{key}_original"], m[f"{key}_final"], m[f"{key}_baseline"]
        return [f"{o:.2f}", f"{f:.2f} ({f / o:.3f}x)", f"{b:.2f} ({b / o:.3f}x)"]
    mib = 2 ** 20
    return {
        "perplexity, held-out text": ppl("ppl"),
        "perplexity, out-of-domain text (never trained on)": ppl("ppl_ood"),
        f"perplexity beyond {m['ppl_far_from']:,} tokens (held-out, {m['ppl_far_context']:,}-token sequences)": ppl("ppl_far"),
        f"RULER mix at {m['ruler_context']:,} tokens ({m['ruler_tasks']} needle tasks x {m['ruler_problems']} problems, 0-100)":
            [f"{m['ruler_original']:.1f}", f"{m['ruler_final']:.1f}", f"{m['ruler_baseline']:.1f}"],
        f"cache at {m['bench_context']:,} tokens": [f"{m['cache_bytes_original'] / mib:.1f} MiB",
                                                    f"{m['cache_bytes_final'] / mib:.1f} MiB ({m['cache_ratio']:.3f}x)",
                                                    "same bytes"],
        f"decode tokens/s at {m['bench_context']:,} tokens":
            [f"{m['decode_tokens_per_s_original']:.1f}",
             f"{m['decode_tokens_per_s_final']:.1f} ({m['decode_speedup']:.2f}x; "
             f"{m['decode_speedup_vs_static_cache']:.2f}x against a static cache)", ""],
        "`make demo`, minutes on 2 cores": ["", f"{m['total_minutes']:.1f}", ""],
    }


def speed_rows(bench: dict) -> dict[str, list[str]]:
    """variant -> decode speed-up against the static-cache original at each context, batch 1."""
    rows = {}
    for ratio in bench["ratios"]:
        if ratio["baseline"] != "original+static-cache" or ratio.get("batch", 1) != 1:
            continue
        kind, beta = re.fullmatch(r"(.+)-beta([0-9.]+)", Path(ratio["model"]).name).groups()  # the variant's folder
        rows.setdefault(f"`{kind}`, beta {beta}", {})[ratio["context"]] = f"{ratio['decode_speedup']:.2f}x"
    return {name: [cells[c] for c in sorted(cells)] for name, cells in rows.items()}


def test_the_quality_table_is_the_example_runs_metrics():
    shown = table_rows("| measure | original | converted | window, equal bytes | source |")
    expected = quality_rows(load(RUN))
    assert set(shown) == set(expected)
    for measure, cells in expected.items():
        assert shown[measure][:3] == cells, measure
        assert shown[measure][3] == f"`{RUN}`"


def test_the_speed_table_is_the_benchmarks_ratios():
    shown = table_rows("| decode speed-up |")
    expected = speed_rows(load(BENCH))
    assert shown and set(shown) <= set(expected)
    for name, cells in shown.items():
        assert cells[:-1] == expected[name], name
        assert cells[-1] == f"`{BENCH}`"


ENGINE = "docs/results/engine.json"


def engine_rows(engine: dict) -> dict[str, list[str]]:
    """measure -> (beta 0.5, beta 0.75) as the README's llama.cpp table shows them."""
    ratio = {(r["model"], r["type"]): r for r in engine["ratios"]}
    ppl = {p["model"]: p for p in engine["perplexity"] if p["context"] == 4096}
    long = {r["model"]: r for r in engine["long"]["ratios"]}

    def both(model: str, pick) -> str:
        return " / ".join(pick(ratio[model, t]) for t in ("f32", "q8_0"))

    rows = {
        "decode at 8,150 tokens, F32 / Q8_0": lambda m: both(m, lambda r: f"{r['decode']['8150']:.2f}x"),
        "decode at 512 tokens, F32 / Q8_0": lambda m: both(m, lambda r: f"{r['decode']['512']:.2f}x"),
        "decode at 32K tokens, Qwen2.5-0.5B's shape (random weights), Q8_0":
            lambda m: f"{long[m]['decode']['32736']:.2f}x",
        "16 sequences after a shared 4K prompt, Q8_0": lambda m: f"{ratio[m, 'q8_0']['batched']:.2f}x",
        "KV cache and state at an 8K context": lambda m: f"{ratio[m, 'f32']['memory']:.2f}x",
        "prefill of 8,150 tokens, F32 / Q8_0": lambda m: both(m, lambda r: f"{r['prefill']:.2f}x"),
        "held-out perplexity at 4,096-token chunks, engine over PyTorch, F32 / Q8_0": lambda m: " / ".join(
            f"{ppl[m][f'engine_{t}'] / ppl[m]['pytorch_f32']:.4f}x" for t in ("f32", "q8_0")),
    }
    return {name: [cell(m) for m in ("beta0.5", "beta0.75")] for name, cell in rows.items()}


def test_the_llama_cpp_table_is_the_engine_benchmarks_ratios():
    shown = table_rows("| in llama.cpp, conversion over original |")
    expected = engine_rows(load(ENGINE))
    assert set(shown) == set(expected)
    for name, cells in expected.items():
        assert shown[name] == [*cells, f"`{ENGINE}`"], name


@pytest.mark.parametrize("path", re.findall(r"`((?:docs|benchmarks|src|tests)/[^`* ]+)`", README))
def test_every_file_the_readme_names_exists(path):
    assert (ROOT / path.rstrip("/")).exists(), path


DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# docs/architecture.md's recipes were tried on throwaway branches: the files they name are not kept
RECIPE_EXAMPLES = {"tests/test_drop_mixer.py", "tests/test_copy.py", "tests/test_identity_mixer.py", "tests/test_induction.py",
                   "tests/ops/test_scale.py"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc):
    """Paths a document names from the repository root (`docs/...`, `benchmarks/...`, `src/...`,
    `tests/...`) exist; runs/ and ../shared are made or brought by the user, so not checked."""
    named = re.findall(r"`((?:docs|benchmarks|src|tests)/[^`* ]+)`", doc.read_text())
    files = [p for p in named if not re.search(r"[{<]|\.[A-Z]", p) and p not in RECIPE_EXAMPLES]  # not symbols
    missing = [p for p in files if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, missing


def test_the_docs_name_every_supported_family():
    """The sentences that list the families, against `SUPPORTED_ARCHITECTURES` (adding one:
    docs/architecture.md, "Recipes")."""
    names = ", ".join(SUPPORTED_ARCHITECTURES)
    assert f"(`model_type` {names})" in README
    method = (ROOT / "docs" / "method.md").read_text()
    assert ", ".join(f"`{name}`" for name in SUPPORTED_ARCHITECTURES) + "," in method
    assert f"supported: {names}`" in (ROOT / "docs" / "models.md").read_text()


def test_the_license_file_is_the_declared_license():
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_mixers_doc_shows_the_example_runs_figures():
    """docs/mixers.md's table of the example run: its rival's and its trained model's row."""
    doc = " ".join((ROOT / "docs" / "mixers.md").read_text().split())  # prose wraps
    m = load(RUN)

    def ppl(key: str, model: str) -> str:
        value, original = m[f"{key}_{model}"], m[f"{key}_original"]
        return f"{value:.2f} ({value / original:.3f}x)"

    rival = (f"| `window` {m['baseline_window']} + {m['sinks']}, untrained (the rival) | {ppl('ppl', 'baseline')} | "
             f"{ppl('ppl_ood', 'baseline')} | {ppl('ppl_far', 'baseline')} | {m['ruler_baseline']:.1f} | "
             f"{100 * m['agreement_top1_baseline']:.1f}% / {m['agreement_kl_baseline']:.3f} |")
    trained = (f"| **`window+mamba2` w{m['window']}, N {m['ssd_state']}, trained** | **{ppl('ppl', 'final')}** | "
               f"**{ppl('ppl_ood', 'final')}** | **{ppl('ppl_far', 'final')}** | **{m['ruler_final']:.1f}** | "
               f"**{100 * m['agreement_top1_final']:.1f}% / {m['agreement_kl_final']:.3f}** |")
    steps = (f"{m['transfer_steps']} + {m['lm_steps']} steps, "
             f"{m['transfer_tokens'] + m['lm_tokens']:,} tokens")
    for expected in (rival, trained, steps, f"| {m['total_minutes']:.1f} minutes |"):
        assert expected in doc, expected


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".json")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_or_result_names_a_machines_own_paths(path):
    """Results and docs name files as the repository does (`runs/...`), not by where this clone lies."""
    found = re.findall(r"(?<![\w.~])/(?:work|root|home)/[\w.-]+", path.read_text())
    assert not found, found[:3]


def table_widths(text: str) -> list[tuple[int, int, int]]:
    """(line number, header cells, row cells) of every Markdown table row; a `|` inside
    backticks or escaped as `\\|` is not a cell border."""
    def width(line: str) -> int:
        return len(re.findall(r"(?<!\\)\|", re.sub(r"`[^`]*`", "", line.strip()))) - 1

    lines, found = text.splitlines(), []
    for number, line in enumerate(lines):
        if line.lstrip().startswith("|") and number + 1 < len(lines) and re.fullmatch(r"\s*\|[-:| ]+\|\s*",
                                                                                       lines[number + 1]):
            row = number + 2
            while row < len(lines) and lines[row].lstrip().startswith("|"):
                found.append((row + 1, width(line), width(lines[row])))
                row += 1
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_has_its_headers_cells(doc):
    bad = [(line, header, row) for line, header, row in table_widths(doc.read_text()) if header != row]
    assert not bad, bad[:3]


def test_a_run_report_escapes_a_bar_inside_a_cell():
    table = {"kl": Metric("kl", "KL(original || model)", lambda results: 0.5, fmt="{:.2f}")}
    lines = render_rows([Row("KL(original || model)", None, "kl", None)], {"kl": 0.5}, table)
    assert table_widths("\n".join(lines)) == [(3, 5, 5)]


def test_the_library_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's example on a tiny model (its name and scores file swapped for the tiny model's),
    then `recurformer generate` on the folder it saved, which has no tokenizer of its own."""
    tiny = save_tiny_model(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. A recurrent state has a fixed size.\n" * 40)
    scores = tmp_path / "scores.json"
    assert main(["analyze", str(tiny), "--data", str(text), "--out", str(scores), "--sequences", "2", "--seq-len",
                 "64", "--ablation-sequences", "1", "--ablation-seq-len", "64", "--ablation-from", "32"]) == 0
    code = README.split("## Library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'recurformer.resolve_model("smollm2-135m")' in code and "docs/results/example-run/scores.json" in code
    code = code.replace('recurformer.resolve_model("smollm2-135m")', repr(str(tiny)))
    code = code.replace('"docs/results/example-run/scores.json"', repr(str(scores)))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert not (tmp_path / "converted" / "tokenizer.json").exists()
    assert main(["generate", "converted/", "--prompt", "The quick", "--max-new-tokens", "3"]) == 0


def test_a_folder_without_tokenizer_or_source_says_how_to_add_one(tmp_path, capsys):
    model = tiny_model("llama")  # built from a config: no folder to record as its source
    convert(model, spec_for(model, 0.5)).save_pretrained(tmp_path / "converted")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "converted"), "--prompt", "x"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "no tokenizer files" in errors[0] and "tokenizer.save_pretrained(" in errors[0]
