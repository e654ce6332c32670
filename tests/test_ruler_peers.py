"""The retrieval comparison at equal bytes (`benchmarks/long_context/`) on tiny random models: a
prefilled answer is `generate`'s; the kept-head presses score as the model attends and keep
what they say; the table scores and ranks rows as documented."""

import json

import pytest
import torch
from benchmark_scripts import benchmark_script
from tiny_models import MIXERS, open_gates, spec_for, tiny_model, tiny_tokenizer

from recurformer import convert
from recurformer.cache import HybridCache
from recurformer.evaluate.generation import prefilled_answer
from recurformer.eviction import score


@pytest.fixture(scope="module")
def press():
    with benchmark_script("peers.kept_press") as module:
        yield module


@pytest.fixture(scope="module")
def table():
    with benchmark_script("peers.ruler_table") as module:
        yield module


def ids(length: int, seed: int = 1) -> list[int]:
    return torch.randint(1, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", ["original", "window+mamba2"])
def test_a_prefilled_answer_is_generates_greedy_answer(kind):
    original = tiny_model("llama")
    model = original if kind == "original" else open_gates(convert(original, spec_for(original, 0.5), MIXERS[kind]))
    context, question = ids(45), ids(5, seed=2)
    answer = prefilled_answer(model, context, question, 6, eos=set())
    generated = model.generate(torch.tensor([context + question]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, 50:].tolist()
    assert answer == generated
    assert prefilled_answer(model, context, question, 6, eos={generated[0]}) == []  # EOS ends it, unreturned
    assert prefilled_answer(model, context, question, 6, eos={(generated[0] + 1) % 97}) == generated
    assert prefilled_answer(model, context, question, 6, eos=set(), stop=lambda a: len(a) == 4) == generated[:4]


def kept_everything(original):
    """A conversion that replaces no group: every layer a HybridAttention with all heads kept."""
    return convert(original, spec_for(original, 0.0), MIXERS["window"])


def prefill(model, context):
    cache = HybridCache(model.config.text_config.num_hidden_layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
    return cache


def test_kvzip_replays_the_context_in_chunks_after_the_chat_templates_user_prefix(press, monkeypatch):
    monkeypatch.setattr(press, "REPLAY_CHUNK", 40)
    tokenizer = tiny_tokenizer()
    plain = press.Replay(tokenizer)
    assert plain.prefix == 0 and plain.suffix == tokenizer.encode("\n", add_special_tokens=False)
    tokenizer.chat_template = "{% for m in messages %}<eos>user: {{ m['content'] }}<eos>{% endfor %}assistant: "
    replay = press.Replay(tokenizer)
    assert replay.prefix == len(tokenizer.encode("<eos>user: ", add_special_tokens=False)) > 0
    assert replay.suffix == tokenizer.encode("<eos>assistant: ", add_special_tokens=False)
    context = ids(90)
    chunks = replay.chunks(context)
    assert [(start, end) for start, end, _ in chunks] == [(replay.prefix, replay.prefix + 40),
                                                          (replay.prefix + 40, replay.prefix + 80),
                                                          (replay.prefix + 80, 90)]
    for number, (start, end, ids_) in enumerate(chunks):
        request = replay.first if number == 0 else replay.later + context[start - 8:start]
        assert ids_ == request + replay.suffix + context[start:end]


def test_kvzip_scores_are_the_attention_the_models_replay_pays(press, monkeypatch):
    """A key's KVzip score is the most attention a replay query of its group pays it, the
    softmax over the sinks, the chunk and the replay: the weights the model computes on the
    context followed by the replay (eager attention), renormalized over those keys."""
    monkeypatch.setattr(press, "REPLAY_CHUNK", 40)
    original = tiny_model("llama", attn_implementation="eager")
    model = kept_everything(original)
    hook = press.KeptPress(model, "kvzip", 1.0, tiny_tokenizer())
    context = ids(90)
    cache = prefill(model, context)
    before = [layer.keys.clone() for layer in cache.layers]
    scores = hook.kvzip_scores(cache, 90)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, before))  # replays on copies
    for start, end, replay in hook.replay.chunks(context):
        with torch.no_grad():
            attentions = original(torch.tensor([context + replay]), output_attentions=True).attentions
        sinks = min(4, start)
        columns = [*range(sinks), *range(start, end), *range(90, 90 + len(replay))]
        for module in model.hybrid_attentions():
            weights = attentions[module.layer_idx][0, :, 90:][..., columns]  # [Hq, R, keys]
            weights = (weights / weights.sum(dim=-1, keepdim=True))[..., sinks:sinks + end - start]
            heads = scores[module.layer_idx].shape[1]
            expected = weights.view(heads, -1, len(replay), end - start).amax(dim=(1, 2))
            torch.testing.assert_close(scores[module.layer_idx][0, :, start:end], expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="tokenizer"):
        press.KeptPress(model, "kvzip", 0.5)


@pytest.mark.parametrize("name", ["knorm", "snapkv", "tova", "expected-attention", "kvzip"])
def test_a_press_keeps_its_best_scored_tokens_and_leaves_the_mixer_state(press, name, monkeypatch):
    monkeypatch.setattr(press, "REPLAY_CHUNK", 40)
    original = tiny_model("llama")
    model = open_gates(convert(original, spec_for(original, 0.5), MIXERS["window+mamba2"]))
    tokenizer = tiny_tokenizer()
    hook = press.KeptPress(model, name, 0.5, tokenizer)
    context = ids(90)
    cache = prefill(model, context)
    before = [(layer.keys.clone(), layer.values.clone(), {k: v.clone() for k, v in (layer.mixer_state or {}).items()})
              for layer in cache.layers]
    inputs = dict(hook.inputs)
    replayed = hook.kvzip_scores(cache, 90) if name == "kvzip" else {}
    hook(cache, len(context))
    for module in model.hybrid_attentions():
        layer = cache.layers[module.layer_idx]
        keys, values, state = before[module.layer_idx]
        assert layer.get_seq_length() == 45 and layer.keys.shape[2] == 45
        assert all(torch.equal(layer.mixer_state[k], v) for k, v in state.items())
        if module.has_attention:
            if name == "kvzip":  # the replay's scores, the 4 sinks first
                scores = replayed[module.layer_idx].clone()
                scores[..., :4] = scores.max() + 1
            else:
                hidden, embeddings = inputs[module.layer_idx]
                scores = score(name, module, hidden, keys, values, embeddings, hook.rotary, len(context))
            best = scores.topk(45, dim=-1).indices.sort(dim=-1).values
            if name == "kvzip":
                assert bool((best[..., :4] == torch.arange(4)).all())
            best = best[..., None].expand(-1, -1, -1, keys.shape[-1])
            assert torch.equal(layer.keys, keys.gather(2, best)) and torch.equal(layer.values, values.gather(2, best))
    hook.remove()
    answer = prefilled_answer(model, context, ids(4, seed=3), 3, eos=set(),
                              compress=press.KeptPress(model, name, 1.0, tokenizer))
    assert answer == prefilled_answer(model, context, ids(4, seed=3), 3, eos=set())


def test_the_table_scores_ranks_and_picks_the_headline_tasks(table, tmp_path):
    index = [{"kind": "ruler", "task": t, "context": 4096, "depth": None, "answers": a}
             for t, a in [("easy", ["111"]), ("easy", ["222"]), ("hard", ["333", "444"]), ("hard", ["555", "666"])]]
    index += [{"kind": "passkey", "task": "passkey", "context": c, "depth": 0.5, "answers": ["12345"]}
              for c in (1024, 4096)]

    def row(budget, kind, completions, cache):
        return {"budget": budget, "kind": kind, "labels": {"4096": kind}, "cache": cache,
                "completions": dict(enumerate(completions)), "seconds": 1.0}

    full = {"1024": 100, "4096": 400}
    ours = {"schema": table.SCHEMA, "problems": "abc", "index": index, "tasks": ["easy", "hard"], "rows": {
        "original": row(None, "original", ["111", "222", "333", "nothing", "12345", "12345"], full),
        "window@0.5": row("0.5", "window", ["111", "x", "333 444", "555", "12345", "no"], {"1024": 60, "4096": 210}),
    }}
    peers = {"schema": table.SCHEMA, "problems": "abc", "rows": {
        "snapkv@0.5": row("0.5", "snapkv", ["x", "x", "x", "x", "x", "x"], {"1024": 60, "4096": 210})}}
    for data in (ours, peers):
        for r in data["rows"].values():
            r["completions"] = {str(k): v for k, v in r["completions"].items()}
    text, points = table.render(ours, peers)
    # original: easy 100, hard (0.5 + 0) / 2 = 25 -> only `easy` is a headline task
    assert "(easy: one problem is at most 50.0 points" in text
    lines = [line for line in text.splitlines() if line.startswith("| `")]
    assert lines[0].startswith("| `original` | original | 1.000 | 100 | 25 | 62.5 | **100.0** | 100% |")
    assert lines[1].startswith("| `window@0.5` | window | 0.525 | 50 | 75 | 62.5 | **50.0** | 50% |")
    assert lines[2].startswith("| `snapkv@0.5` | snapkv | 0.525 | 0 | 0 | 0.0 | **0.0** | 0% |")
    assert "| `window@0.5` | 1/1 | 0/1 | 0.600 | 0.525 |" in text
    assert points["our `window`, no training"] == [(0.525, 50.0)]
    peers["problems"] = "other"
    with pytest.raises(table.TableError, match="different problem sets"):
        table.render(ours, peers)
    del ours["rows"]["original"]["completions"]["0"]
    with pytest.raises(table.TableError, match="has not answered"):
        table.render(ours, None)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(table.TableError, match="is not a"):
        table.load(bad, "our rows")


def test_a_tagged_budget_is_ordered_by_its_fraction_and_plotted_as_its_own_method(table):
    index = [{"kind": "ruler", "task": "easy", "context": 4096, "depth": None, "answers": ["111"]}]

    def row(budget, kind, answer, cache):
        return {"budget": budget, "kind": kind, "labels": {"4096": kind}, "cache": {"4096": cache},
                "completions": {"0": answer}, "seconds": 1.0}

    ours = {"schema": table.SCHEMA, "problems": "abc", "index": index, "tasks": ["easy"], "rows": {
        "conversion@0.25-ablation-retrieval": row("0.25-ablation-retrieval", "conversion", "111", 100),
        "window@0.25": row("0.25", "window", "x", 100),
        "conversion@0.25": row("0.25", "conversion", "x", 100),
        "conversion@0.5": row("0.5", "conversion", "111", 200),
        "original": row(None, "original", "111", 400),
    }}
    text, points = table.render(ours, None)
    names = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
    assert names == ["original", "conversion@0.5", "conversion@0.25", "conversion@0.25-ablation-retrieval",
                     "window@0.25"]
    assert points["our conversion (trained)"] == [(0.5, 100.0), (0.25, 0.0)]
    assert points["our conversion (trained), ablation-retrieval"] == [(0.25, 100.0)]
    assert table.split_budget("0.25-ablation-retrieval") == (0.25, "ablation-retrieval")
    for bad in ("0.25r", "half", "1.5", "0.25-"):
        with pytest.raises(table.TableError, match="named by its cache fraction"):
            table.split_budget(bad)


def test_the_headline_interval_is_a_paired_bootstrap_over_each_tasks_problems(table):
    index = [{"kind": "ruler", "task": "easy", "context": 4096, "depth": None, "answers": [str(n)]} for n in range(4)]
    index.append({"kind": "passkey", "task": "passkey", "context": 1024, "depth": 0.5, "answers": ["12345"]})

    def row(budget, kind, right):
        return {"budget": budget, "kind": kind, "labels": {"4096": kind}, "cache": {"4096": 100, "1024": 25},
                "completions": {str(n): str(n) if n in right else "x" for n in range(5)}, "seconds": 1.0}

    ours = {"schema": table.SCHEMA, "problems": "abc", "index": index, "tasks": ["easy"], "rows": {
        "original": row(None, "original", {0, 1, 2, 3}), "window@0.5": row("0.5", "window", {0, 1}),
        "conversion@0.5": row("0.5", "conversion", {0, 1})}}
    text, _ = table.render(ours, None)
    ruler_table = text.split("Passkey at equal bytes")[0]
    lines = {line.split("`")[1]: line for line in ruler_table.splitlines() if line.startswith("| `")}
    assert lines["original"].endswith("| 100% | 100.0-100.0 |")  # every resampling of all-correct answers is 100
    low, high = (float(v) for v in lines["window@0.5"].rsplit("|", 2)[1].split("-"))
    assert 0 <= low < 50 < high <= 100
    half = [s[0] for s in table.bootstrap_headlines([table.scores(ours["rows"]["window@0.5"], index)], index, ["easy"])]
    assert len(half) == table.BOOTSTRAP_ROUNDS and set(half) <= {0, 25, 50, 75, 100} and len(set(half)) > 2
    assert table.interval(list(range(101)), 0.9) == (5, 95)
    # paired: two rows with the same answers differ by exactly 0 in every resampling
    assert table.compare(ours, None, "window@0.5", "conversion@0.5") == (
        "window@0.5 50.0 - conversion@0.5 50.0 = +0.0 (90% interval +0.0 to +0.0, 2000 resamplings of the problems)")
    assert "= +50.0 (90% interval +" in table.compare(ours, None, "original", "window@0.5")
    with pytest.raises(table.TableError, match="row 'bogus' does not exist"):
        table.compare(ours, None, "original", "bogus")


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0.25r=FOLDER", "--rows", "original"], "--budget '0.25r': a budget is named by its cache fraction"),
    (["--budget", "0.25=FOLDER", "--rows", "duo-retrieval@0.25"], "duo-retrieval rows need --retrieval-scores"),
    (["--budget", "0.25=FOLDER", "--rows", "bogus@0.25"], "rows are original or KIND@BUDGET"),
])
def test_ruler_ours_refuses_bad_rows_and_budgets_before_loading_a_model(argv, message, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    argv = [arg.replace("FOLDER", str(tmp_path)) for arg in argv]
    with benchmark_script("peers.ruler_ours") as module:
        monkeypatch.setattr("sys.argv", ["ruler_ours.py", *argv])
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
        with pytest.raises(SystemExit, match=message):
            module.main()


@pytest.mark.parametrize("argv, message", [
    (["--problems", "MISSING"], "no such file: .*missing.json"),
    (["--row", "tova@0.25"], "--row tova@0.25: not in"),
    (["--digest", "other"], "answers another problem set"),
])
def test_kvzip_allocation_refuses_bad_input_before_loading_a_model(argv, message, tmp_path, monkeypatch):
    problems, peers = tmp_path / "problems.json", tmp_path / "peers.json"
    problems.write_text(json.dumps({"digest": "abc", "model": "m", "contexts": [], "eos": []}))
    digest = argv[1] if argv[0] == "--digest" else "abc"
    peers.write_text(json.dumps({"problems": digest, "rows": {"kvzip@0.25": {"cache": 1, "full": 4, "contexts": {}}}}))
    argv = [] if argv[0] == "--digest" else [arg.replace("MISSING", str(tmp_path / "missing.json")) for arg in argv]
    with benchmark_script("peers.kvzip_allocation") as module:
        monkeypatch.setattr("sys.argv", ["kvzip_allocation.py", "--problems", str(problems), "--peers", str(peers),
                                         *argv, "--out", str(tmp_path / "out.json")])
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
        with pytest.raises(SystemExit, match=message):
            module.main()
    assert not (tmp_path / "out.json").exists()


def test_every_row_kind_has_a_name_in_the_plot(table):
    with benchmark_script("peers.kept_press") as press:
        presses = press.PRESSES
    assert table.kind_name("compose-global-kvzip") == "our conversion + kvpress KVzip on the kept heads, ranked together"
    assert table.kind_name("compose-tova", "0.25-ablation-retrieval") == \
        "our conversion + kvpress TOVA on the kept heads, ablation-retrieval"
    for name in presses:
        assert "on the kept heads" in table.kind_name(f"compose-{name}") + table.kind_name(f"compose-global-{name}")
