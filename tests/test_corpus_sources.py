"""The default corpora on a machine without the shared folder (`corpus_sources.py`): the same
texts by dataset id from an offline `datasets` cache, the Lee corpus out of a PyPI wheel checked
by its sha256, one line when a source is out of reach, and `run` configured from them."""

import hashlib
import zipfile
from pathlib import Path

import datasets
import pytest
from test_dataset_ids import lay_out

import recurformer.corpus_sources as corpus_sources
from recurformer.corpus_sources import shared_corpora
from recurformer.data import DATA_ENV, EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA, TRAIN_CORPORA, DataError, corpora_folder
from recurformer.dataset_ids import parse_dataset_id
from recurformer.hub.registry import ModelResolutionError
from recurformer.run import RunConfig

WIKI = [" = Valkyria Chronicles = \n", "\n", " The game began development in 2010 , carrying over a large portion .\n"] * 20
PLAYS = ["First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"]
LEE = OUT_OF_DOMAIN_CORPORA[0]
NEWS = b"Australian batsman made a century on the first day of the test in Hobart .\n" * 20


def fake_wheel(content: bytes):
    """A `download_wheel` that leaves a wheel holding the Lee corpus's member with `content`."""
    calls = []

    def download(spec, dest, progress):
        calls.append(spec)
        wheel = Path(dest) / "gensim-4.4.0-cp311-cp311-manylinux.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("gensim/test/test_data/lee_background.cor", content)
        return wheel

    return download, calls


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """A working directory with no shared corpora folder beside it and no $RECURFORMER_DATA; the three
    dataset ids in an offline datasets cache; the Lee wheel as `fake_wheel(NEWS)` serves it."""
    (tmp_path / "clone").mkdir()
    monkeypatch.chdir(tmp_path / "clone")
    monkeypatch.delenv(DATA_ENV, raising=False)
    cache = tmp_path / "hf-datasets"
    lay_out(cache, "Salesforce/wikitext", "wikitext-2-v1", "validation", WIKI)
    lay_out(cache, "Salesforce/wikitext", "wikitext-2-raw-v1", "test", WIKI[::-1])
    lay_out(cache, "karpathy/tiny_shakespeare", "default", "train", PLAYS)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("RECURFORMER_CACHE", str(tmp_path / "recurformer-cache"))
    lee = corpus_sources.SOURCES[LEE]
    monkeypatch.setitem(corpus_sources.SOURCES, LEE,
                        corpus_sources.WheelMember(lee.spec, lee.member, hashlib.sha256(NEWS).hexdigest()))
    download, calls = fake_wheel(NEWS)
    monkeypatch.setattr(corpus_sources, "download_wheel", download)
    return tmp_path, calls


def test_the_defaults_come_from_the_public_sources_once(fresh_clone):
    tmp_path, calls = fresh_clone
    train, held_out, ood = (shared_corpora(names) for names in (TRAIN_CORPORA, EVAL_CORPORA, OUT_OF_DOMAIN_CORPORA))
    assert [Path(p).read_text() for p in train] == ["".join(WIKI), "".join(PLAYS)]
    assert Path(held_out[0]).read_text() == "".join(WIKI[::-1])
    assert Path(ood[0]).read_bytes() == NEWS and calls == ["gensim==4.4.0"]
    assert all(str(tmp_path / "recurformer-cache") in p for p in train + held_out + ood)
    assert shared_corpora(OUT_OF_DOMAIN_CORPORA) == ood and calls == ["gensim==4.4.0"]  # cached: no second fetch
    config = RunConfig()
    assert (config.data, config.eval_data, config.ood_data) == (train, held_out, ood)


def test_a_wheel_member_of_another_checksum_is_refused(fresh_clone, monkeypatch):
    download, _ = fake_wheel(b"not the corpus\n")
    monkeypatch.setattr(corpus_sources, "download_wheel", download)
    with pytest.raises(DataError, match=rf"^{LEE}: gensim/test/test_data/lee_background.cor of the "
                                        r"PyPI wheel gensim==4.4.0 does not have the expected sha256; not used$"):
        shared_corpora(OUT_OF_DOMAIN_CORPORA)
    assert not list((fresh_clone[0] / "recurformer-cache" / "corpora").iterdir())  # nothing half-written


def test_sources_out_of_reach_are_one_line(fresh_clone, monkeypatch):
    def offline(spec, dest, progress):
        raise ModelResolutionError(f"could not download {spec} from PyPI (no network?)")

    monkeypatch.setattr(corpus_sources, "download_wheel", offline)
    with pytest.raises(DataError, match=rf"^{LEE}: could not fetch .* \(could not download "
                                        r"gensim==4.4.0 from PyPI \(no network\?\)\)$"):
        shared_corpora(OUT_OF_DOMAIN_CORPORA)
    monkeypatch.setitem(corpus_sources.SOURCES, TRAIN_CORPORA[1], "karpathy/absent:default:train")
    with pytest.raises(DataError, match=r"^karpathy/absent:default:train: not in the datasets cache"):
        shared_corpora(TRAIN_CORPORA)


def test_the_shared_folder_or_the_variable_wins(fresh_clone, monkeypatch):
    tmp_path, calls = fresh_clone
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "absent"))  # set on purpose: a missing file is an error when read
    assert shared_corpora(EVAL_CORPORA) == [str(tmp_path / "absent" / EVAL_CORPORA[0])]
    monkeypatch.delenv(DATA_ENV)
    (Path.cwd() / corpora_folder()).mkdir(parents=True)
    assert shared_corpora(EVAL_CORPORA) == [str(corpora_folder() / EVAL_CORPORA[0])] and not calls


@pytest.mark.real_model
@pytest.mark.slow
def test_a_fresh_clone_runs_quick_from_dataset_ids(tmp_path):
    """issue 46's check: `run --quick` of the real model in a folder with no shared corpora beside
    it, the default corpora from an offline datasets cache (laid out from the shared files, as the
    ids would leave it) and the Lee corpus fetched before (in recurformer's cache)."""
    import os
    import subprocess
    import sys

    shared = corpora_folder().resolve()
    if not shared.is_dir():
        pytest.skip("needs the shared corpora to lay out the cache")
    cache = tmp_path / "hf-datasets"
    for name, source in corpus_sources.SOURCES.items():
        if isinstance(source, str):  # a dataset id
            lay_out(cache, *parse_dataset_id(source), (shared / name).read_text().splitlines(keepends=True))
    ours = tmp_path / "recurformer-cache"
    (ours / "corpora").mkdir(parents=True)
    (ours / "corpora" / LEE).write_bytes((shared / LEE).read_bytes())
    for entry in ("models", "kernels"):  # the model and kernels this machine already has
        if (corpus_sources.cache_root() / entry).exists():
            (ours / entry).symlink_to(corpus_sources.cache_root() / entry)
    (tmp_path / "clone").mkdir()
    env = {k: v for k, v in os.environ.items() if k != DATA_ENV}
    env.update(HF_DATASETS_CACHE=str(cache), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", RECURFORMER_CACHE=str(ours))
    done = subprocess.run([sys.executable, "-m", "recurformer.cli", "run", "--quick", "--out", "quick"],
                          cwd=tmp_path / "clone", env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    run = (tmp_path / "clone" / "quick" / "run.json").read_text()
    assert "Salesforce--wikitext--wikitext-2-raw-v1--test.txt" in run and f"corpora/{LEE}" in run
