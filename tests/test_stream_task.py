"""`--task stream` (`tasks/stream.py`, `evaluate/stream.py`): the streams are seeded and say what
they test, the budget holds at every point of a stream, and bad options are one line."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import MIXERS, open_gates, spec_for, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from recurformer import convert, retrieval_mix
from recurformer.cli import main
from recurformer.config import ConfigError
from recurformer.data import DataError
from recurformer.evaluate import TASKS
from recurformer.evaluate import stream as stream_evaluation
from recurformer.evaluate.stream import StreamOptions, evaluate, feed_stream, original_bytes_per_token, tokens_kept
from recurformer.eviction import as_hybrid
from recurformer.tasks import shared_context
from recurformer.tasks import stream as stream_task
from recurformer.tasks.ruler import Sources
from recurformer.tasks.stream import INSTRUCTION, WORDS, distance_bin, generate_stream, generate_streams

TEXT = ("The river runs past the old mill and the town . Boats carry grain to the market every week . "
        "In winter the water freezes and the mill stands still . ") * 40
WORDS_OF_STREAMS = [TEXT, INSTRUCTION, *WORDS, "Dial", "is", "set", "to", "Gate", "has", "counted", "visitors", "Shelf",
                    "receives", "a", "holds", "[log]", "[check]", *"0123456789"]
VOCABULARY = sorted(set(re.findall(r"\w+|[^\w\s]+", " ".join(WORDS_OF_STREAMS)))
                    | {f"{letter}{n}" for letter in "KLMNPRST" for n in range(10, 100)})  # the dials' names


def word_tokenizer():
    """Every word and punctuation mark of the streams one token (a word-level tokenizer:
    unknown words are <unk>); it decodes with a space between tokens ("[ log ] Dial K17 ...")."""
    vocab = {word: i for i, word in enumerate(["<unk>", "<eos>", *VOCABULARY])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "held-out.txt"
    path.write_text(TEXT)
    return [str(path)]


def model_for(tokenizer, **fields):
    return tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024, **fields)


def test_a_stream_is_seeded_and_its_answers_are_its_logs_state(tokenizer):
    sources = Sources.from_text(TEXT)
    stream = generate_stream(tokenizer, sources, 600, ("set", "count", "append"), index=3)
    assert stream == generate_stream(tokenizer, sources, 600, ("set", "count", "append"), index=3)
    assert stream != generate_stream(tokenizer, sources, 600, ("set", "count", "append"), index=4)
    assert generate_streams(tokenizer, sources, 2, 600, ("set",))[1] == generate_stream(tokenizer, sources, 600,
                                                                                          ("set",), index=1)
    assert len(stream.ids) + 4 <= 600 and {u.kind for u in stream.units} <= {"set", "count", "append"}
    ids = list(stream.ids)
    for unit in stream.units:
        assert ids[unit.start:unit.start + len(unit.tokens)] == list(unit.tokens)
        assert tokenizer.decode(list(unit.tokens)).strip() == unit.value
        before = tokenizer.decode(ids[:unit.start])
        if unit.kind in ("set", "count"):  # the latest value the log gave; the earlier ones stale
            name, verb = re.findall(r"\[ check \] ((?:Dial|Gate) \w+) (is set to|has counted)$", before)[0]
            given = re.findall(rf"\[ log \] {name} {verb} (\w+)", before)
            assert unit.value == given[-1] and list(unit.stale) == given[:-1]
            if unit.kind == "count":
                assert given == [str(n) for n in range(1, len(given) + 1)]
        if unit.kind == "append":
            shelf = re.findall(r"\[ check \] (Shelf \d) holds :", before)[-1]
            assert unit.value in re.findall(rf"\[ log \] {shelf} receives a (\w+)", before)
        assert unit.distance >= 1
    assert tokenizer.decode(ids).endswith("is set to") and stream.free_value in WORDS


def test_a_streams_templates_are_its_own(tokenizer):
    """No other task's needle, question or answer template, and none of the training mix's,
    occurs in a stream; nor a stream's log in them."""
    text = tokenizer.decode(list(generate_stream(tokenizer, Sources.from_text(TEXT), 800, ("set", "count", "append"),
                                                 index=0).ids))
    foreign = ["lock code", "tracking ID", "password", "Inventory note", "Filing note", "Naming note", "Calendar note",
               "magic number", "pass key", *retrieval_mix.NAMES, *retrieval_mix.NOUNS]
    words = set(re.findall(r"\w+", text.lower()))
    assert not [f for f in foreign if (f.lower() in words if " " not in f else f.lower() in text.lower())]
    assert not [w for w in ("log", "check", "dial", "shelf") if w in shared_context.INSTRUCTION.lower()]


def test_a_stream_has_the_dials_and_the_density_asked(tokenizer):
    sources = Sources.from_text(TEXT)
    for dials in (1, 3):
        text = tokenizer.decode(list(generate_stream(tokenizer, sources, 900, ("set",), index=0, dials=dials).ids))
        assert len(set(re.findall(r"Dial (\w+)", text))) == dials
    dense, sparse = (generate_stream(tokenizer, sources, 900, ("set", "count"), index=0, gap=g) for g in (20, 200))
    assert tokenizer.decode(list(dense.ids)).count("[") > 2 * tokenizer.decode(list(sparse.ids)).count("[")


def test_distance_bins():
    assert [distance_bin(d) for d in (0, 255, 256, 1023, 1024, 2047, 2048, 9000)] == \
        ["0-255", "0-255", "256-1023", "256-1023", "1024-2047", "1024-2047", "2048+", "2048+"]


def test_without_a_budget_the_stream_is_scored_from_the_full_forward(tokenizer):
    """Fed in chunks, each answer's log-probability and correctness are the full forward's."""
    model = as_hybrid(model_for(tokenizer))
    stream = generate_stream(tokenizer, Sources.from_text(TEXT), 500, ("set", "count", "append"), index=0)
    record = feed_stream(model, tokenizer, stream, 64, None, 3, set())
    with torch.no_grad():
        logits = model(torch.tensor([list(stream.ids)])).logits[0].log_softmax(dim=-1)
    for unit, scored in zip(stream.units, record["units"]):
        rows = logits[unit.start - 1:unit.start - 1 + len(unit.tokens)]
        gold = torch.tensor(unit.tokens)
        assert scored["logprob"] == pytest.approx(float(rows.gather(1, gold[:, None]).mean()), abs=1e-4)
        assert scored["correct"] == bool((rows.argmax(dim=-1) == gold).all())
    first = int(logits[-1].argmax())
    assert record["free"]["completion"].split()[0] == tokenizer.decode([first]).strip()


@pytest.mark.parametrize("press", ["streaming", "tova", "keydiff", "expected-attention"])
@pytest.mark.parametrize("kind", ["original", "window+mamba2"])
def test_a_budget_holds_at_every_point_of_the_stream(tokenizer, text, press, kind):
    """The cache never holds more than the budget's bytes (the evaluator checks its peak), and
    holding half loses answers only where evicting changed them: scores differ from the full cache's."""
    original = model_for(tokenizer)
    model = original if kind == "original" else open_gates(convert(original, spec_for(original, 0.5),
                                                                   MIXERS[kind]))
    options = dict(data=text, tokens=512, streams=2, chunk=32)
    full = evaluate(model, tokenizer, StreamOptions(**options), progress=False)
    capped = evaluate(model, tokenizer, StreamOptions(**options, press=press, budget=0.25), progress=False)
    assert capped["budget_bytes"] == round(0.25 * 512 * original_bytes_per_token(model))
    assert capped["peak_bytes"] <= capped["budget_bytes"] < full["peak_bytes"]
    assert capped["kept_tokens"] > 0 and capped["digest"] == full["digest"]
    logprobs = lambda result: [u["logprob"] for r in result["records"] for u in r["units"]]
    assert logprobs(capped) != logprobs(full)


def test_a_budget_the_whole_cache_fits_evicts_nothing(tokenizer, text):
    original = model_for(tokenizer)
    model = open_gates(convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"]))
    options = StreamOptions(data=text, tokens=512, streams=1, chunk=32, press="tova", budget=1.0)
    assert tokens_kept(as_hybrid(model), options) is None


def test_the_summary_counts_every_answer(tokenizer, text):
    result = evaluate(model_for(tokenizer), tokenizer, StreamOptions(data=text, tokens=512, streams=3, chunk=32),
                      progress=False)
    summary, units = result["summary"], [u for r in result["records"] for u in r["units"]]
    assert sum(k["n"] for k in summary["by_kind"].values()) == len(units)
    assert sum(b["n"] for b in summary["by_distance"].values()) == len(units)
    assert summary["accuracy"]["low"] <= summary["accuracy"]["mean"] <= summary["accuracy"]["high"]
    assert result["headline"] == summary["accuracy"]["mean"] and summary["free"]["n"] == 3
    json.dumps(result)


@pytest.mark.parametrize("change, message", [
    (dict(press="h2o", budget=0.5), "--press: unknown 'h2o'; choose one of none, streaming"),
    (dict(press="tova"), "--press and --budget go together"),
    (dict(budget=0.5), "--press and --budget go together"),
    (dict(press="tova", budget=1.5), "--budget must be a fraction in (0, 1], got 1.5"),
    (dict(kinds="count"), "--kinds must include set"),
    (dict(kinds="set,tally"), "--kinds: unknown 'tally'"),
    (dict(tokens=100), "--tokens must be >= 256"),
    (dict(dials=9), "--dials must be in [1, 8], got 9"),
    (dict(gap=1), "--gap must be >= 2, got 1"),
])
def test_bad_options_are_one_line(text, change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        StreamOptions(data=text, **change)


def test_a_budget_too_small_for_the_state_and_a_chunk_is_one_line(tokenizer, text):
    original = model_for(tokenizer)
    model = open_gates(convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"]))
    with pytest.raises(ConfigError, match=r"^--budget 0.01 holds .* bytes: not the replaced heads' state"):
        evaluate(model, tokenizer, StreamOptions(data=text, tokens=512, streams=1, chunk=32, press="tova",
                                                 budget=0.01), progress=False)


def test_a_stream_beyond_the_models_positions_is_refused_before_any_work(tokenizer, text):
    config = model_for(tokenizer).config
    with pytest.raises(ConfigError, match=r"--tokens 2,048 is more than the model's positions \(1,024\)"):
        TASKS["stream"].check(StreamOptions(data=text, tokens=2048), config)


def test_text_too_short_for_a_stream_is_one_line(tokenizer, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("")
    with pytest.raises(DataError, match="--task stream: "):
        evaluate(model_for(tokenizer), tokenizer, StreamOptions(data=[str(short)], tokens=512, streams=1),
                 progress=False)


def test_streams_without_a_check_are_one_line(tokenizer, text, monkeypatch):
    monkeypatch.setattr(stream_task, "WRITE_SHARE", 1.0)  # every log line a write: nothing is checked
    with pytest.raises(DataError, match=r"^--task stream: 512-token streams hold no check of the log; ask for longer"):
        evaluate(model_for(tokenizer), tokenizer, StreamOptions(data=text, tokens=512, streams=2), progress=False)


def test_eval_refuses_an_unknown_press_with_exit_2_and_writes_nothing(tmp_path, text, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", str(tmp_path / "nowhere"), "--task", "stream", "--press", "h2o", "--budget", "0.5",
                 "--data", *text, "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "--press: unknown 'h2o'" in capsys.readouterr().err


def test_the_streaming_benchmark_keeps_a_kind_only_where_the_original_answers_60_percent(tmp_path):
    with benchmark_script("long_context.streaming") as streaming:
        good = {"summary": {"by_kind": {"set": {"n": 9, "accuracy": 75.0}, "count": {"n": 4, "accuracy": 60.0}}}}
        streaming.check_kinds(good, ("set", "count"))
        weak = {"summary": {"by_kind": {"set": {"n": 9, "accuracy": 75.0}, "append": {"n": 4, "accuracy": 40.0}}}}
        with pytest.raises(SystemExit, match=r"answers append 40%, below 60%: keep --kinds set$"):
            streaming.check_kinds(weak, ("set", "append"))


def test_the_streaming_benchmark_compares_the_capped_conversion_paired_by_stream(tmp_path, tokenizer, text):
    """The comparisons pair the rows stream by stream: the conversion against the best press,
    the window and the full original."""
    with benchmark_script("long_context.streaming") as streaming:
        model = model_for(tokenizer)
        options = StreamOptions(data=text, tokens=1024, streams=3, chunk=32)
        row = streaming.measure("original", model, tokenizer, options, tmp_path, "runs/x/final")
        assert len(row["per_stream"]) == 3

        def shifted(points: float) -> dict:
            return {**row, "headline": row["headline"] + points,
                    "per_stream": [[v + points for v in s] for s in row["per_stream"]]}

        rows = {"original": row, "tova@0.5": shifted(-20), "snapkv@0.5": shifted(-10), "window+snapkv@0.5": shifted(-5),
                "conversion+snapkv@0.5": shifted(-2)}
        compared = streaming.comparisons(rows, [0.5])
        found = {(c["against"]): (c["difference"], c["low"], c["high"]) for c in compared}
        assert [c["against"] for c in compared][:2] == ["snapkv@0.5", "tova@0.5"]  # every press, the best first
        assert found["snapkv@0.5"] == pytest.approx((8.0, 8.0, 8.0))
        assert found["tova@0.5"] == pytest.approx((18.0, 18.0, 18.0))
        assert found["window+snapkv@0.5"] == pytest.approx((3.0, 3.0, 3.0))
        assert found["original"] == pytest.approx((-2.0, -2.0, -2.0))


def test_the_streaming_benchmark_keeps_each_stream_and_measures_only_the_missing_ones(tmp_path, tokenizer, text,
                                                                                         monkeypatch):
    """A row's streams are kept as they are measured: a rerun with more streams feeds only the
    new ones, and gives what measuring them all at once gives; other options measure afresh."""
    with benchmark_script("long_context.streaming") as streaming:
        model, fed = model_for(tokenizer), []
        feed = stream_evaluation.feed_stream
        monkeypatch.setattr(stream_evaluation, "feed_stream", lambda *args: fed.append(args[2]) or feed(*args))
        options = StreamOptions(data=text, tokens=1024, streams=2, chunk=32)
        streaming.measure("original", model, tokenizer, options, tmp_path, "runs/x/final")
        assert len(fed) == 2 and sorted(json.loads((tmp_path / "original.json").read_text())["records"]) == ["0", "1"]
        grown = streaming.measure("original", model, tokenizer, replace(options, streams=3), tmp_path, "runs/x/final")
        assert len(fed) == 3 and fed[-1] not in fed[:2]  # the third stream only
        fresh = streaming.measure("original", model, tokenizer, replace(options, streams=3), tmp_path / "fresh",
                                  "runs/x/final")
        assert grown == fresh and len(fed) == 6
        streaming.measure("original", model, tokenizer, replace(options, chunk=64, streams=1), tmp_path, "runs/x/final")
        assert len(fed) == 7  # another chunk: measured again


def test_the_streaming_benchmark_pairs_kvpress_rows_with_ours_on_the_same_streams(tmp_path, text):
    """kvpress's DecodingPress rows are compared with our row of the same press and budget on the
    streams both read, paired by stream; a row of ours made on other streams is not used."""
    with benchmark_script("long_context.streaming") as streaming:
        options = StreamOptions(data=text, tokens=1024, streams=3, chunk=32, press="streaming", budget=0.5)
        correct = [[1, 0], [1], [0, 0, 1]]  # ours, stream by stream
        records = {str(i): {"units": [{"correct": bool(c)} for c in u]} for i, u in enumerate(correct)}
        (tmp_path / "streaming@0.5.json").write_text(json.dumps({"options": {**asdict(options), "streams": None},
                                                                 "records": records}))
        units = [[1, 0], [0], [0, 1, 1]]  # kvpress: right, wrong; wrong; wrong, right, right
        row = {"label": "kvpress DecodingPress(StreamingLLM), target_size 448",
               "streams": {str(i): {"units": [{"correct": bool(c)} for c in u], "peak_tokens": 480}
                           for i, u in enumerate(units)}}
        saved = {"options": {**asdict(options), "data": ["x.txt"]}, "rows": {"streaming-llm@0.5": row}}
        saved["options"]["data"] = [Path(text[0]).name]
        path = tmp_path / "stream-kvpress.json"
        path.write_text(json.dumps(saved))
        [check] = streaming.kvpress_check(streaming.read_kvpress(path), path.name, tmp_path)
        assert check["ours"] == "streaming@0.5" and check["streams"] == 3 and check["peak_tokens"] == 480
        # each stream weighed alike, as the headline: kvpress (50 + 0 + 66.7) / 3, ours (50 + 100 + 33.3) / 3
        assert check["kvpress_accuracy"] == pytest.approx(350 / 9) and check["ours_accuracy"] == pytest.approx(550 / 9)
        assert check["difference"] == pytest.approx(-200 / 9)
        assert check["low"] <= check["difference"] <= check["high"]
        path.write_text(json.dumps({**saved, "options": {**saved["options"], "dials": options.dials + 1}}))
        assert streaming.kvpress_check(streaming.read_kvpress(path), path.name, tmp_path) == []  # other streams
        assert streaming.read_kvpress(tmp_path / "missing.json") is None


@pytest.mark.parametrize("budgets, message", [("0.5,x", "--budgets: '0.5,x' is not a comma-separated list of fractions"),
                                              ("2", "--budget must be a fraction in (0, 1], got 2.0")])
def test_the_streaming_benchmark_refuses_a_bad_budget_before_any_work(tmp_path, capsys, budgets, message):
    with benchmark_script("long_context.streaming") as streaming:
        code = streaming.main(["--converted", str(tmp_path / "nowhere"), "--budgets", budgets,
                               "--rows", str(tmp_path / "rows"), "--out", str(tmp_path / "out")])
    assert code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no model read, no row written


def test_the_streaming_benchmark_refuses_a_damaged_kvpress_file_before_any_work(tmp_path, capsys):
    damaged = tmp_path / "stream-kvpress.json"
    damaged.write_text('{"rows": {"tova@0.5": ')
    with benchmark_script("long_context.streaming") as streaming:
        code = streaming.main(["--converted", str(tmp_path / "nowhere"), "--kvpress", str(damaged),
                               "--rows", str(tmp_path / "rows"), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2 and f"--kvpress {damaged}: truncated" in error and len(error.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream-kvpress.json"]  # no model read, nothing written
