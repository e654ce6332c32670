"""Text by Hugging Face dataset id (`dataset_ids.py`): resolved offline from a cache laid out as
the `datasets` library lays it out, written once into a text file that every command reads;
an id neither cached nor reachable is a one-line error naming it."""

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
from tiny_models import save_tiny_model

from recurformer.cli import main
from recurformer.data import DataError
from recurformer.dataset_ids import dataset_file, is_dataset_id, parse_dataset_id, text_file

ROWS = [" = Valkyria Chronicles = \n", "\n", " The game began development in 2010 , carrying over a large portion .\n",
        " It met with positive sales in Japan , and was praised by both Japanese and western critics .\n"] * 30


def lay_out(cache: Path, name: str, config: str, split: str, rows: list[str]) -> None:
    """A prepared dataset in `cache` as `datasets.load_dataset` leaves it: `org___name/config/
    version/hash/` with the split's Arrow file and `dataset_info.json`."""
    folder = cache / name.replace("/", "___") / config / "0.0.0" / "0123abcd"
    folder.mkdir(parents=True)
    table = pa.table({"text": rows})
    with pa.OSFile(str(folder / f"{name.split('/')[1]}-{split}.arrow"), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema)
        writer.write_table(table)
        writer.close()
    datasets.DatasetInfo(features=datasets.Features({"text": datasets.Value("string")}), config_name=config,
                         dataset_name=name.split("/")[1], builder_name="parquet", version="0.0.0",
                         splits=[{"name": split, "num_bytes": 0, "num_examples": len(rows),
                                  "dataset_name": name.split("/")[1]}]).write_to_directory(str(folder))


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A datasets cache holding `org/tiny-wiki` (config `raw`, split `test`), the hub out of reach,
    and recurformer's own cache in the temporary directory."""
    cache = tmp_path / "hf-datasets"
    lay_out(cache, "org/tiny-wiki", "raw", "test", ROWS)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("RECURFORMER_CACHE", str(tmp_path / "recurformer-cache"))
    return tmp_path


def test_an_id_is_read_from_the_datasets_cache_into_a_text_file_once(offline_cache, monkeypatch):
    path = Path(text_file("org/tiny-wiki:raw:test"))
    assert path == dataset_file("org/tiny-wiki:raw:test") and path.read_text() == "".join(ROWS)
    assert str(offline_cache / "recurformer-cache") in str(path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("read the dataset again"))
    assert text_file("org/tiny-wiki:raw:test") == str(path)


def test_what_names_a_dataset(tmp_path, monkeypatch):
    assert parse_dataset_id("Salesforce/wikitext:wikitext-2-raw-v1:test") == ("Salesforce/wikitext",
                                                                               "wikitext-2-raw-v1", "test")
    assert parse_dataset_id("karpathy/tiny_shakespeare") == ("karpathy/tiny_shakespeare", None, "train")
    assert is_dataset_id("org/name:cfg") and not is_dataset_id("text.txt") and not is_dataset_id("../corpora/x.txt")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "file.txt").write_text("a file that looks like an id")
    assert not is_dataset_id("org/file.txt") and text_file("org/file.txt") == "org/file.txt"


def test_an_id_neither_cached_nor_reachable_is_one_line_naming_it(offline_cache):
    with pytest.raises(DataError, match=r"^org/absent:raw:test: not in the datasets cache and not fetched"):
        text_file("org/absent:raw:test")
    assert not dataset_file("org/absent:raw:test").exists()


def test_a_command_reads_text_by_id(offline_cache, capsys):
    model = save_tiny_model(offline_cache / "model")
    out = offline_cache / "ppl.json"
    assert main(["eval", str(model), "--task", "ppl", "--data", "org/tiny-wiki:raw:test", "--context", "64",
                 "--max-tokens", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ppl"] > 1 and result["tokens"] > 0
    capsys.readouterr()
    assert main(["eval", str(model), "--task", "ppl", "--data", "org/absent", "--out", str(offline_cache / "x.json")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "org/absent: not in the datasets cache" in errors[0]
    assert not (offline_cache / "x.json").exists()
