"""`recurformer export`: a model as one GGUF file for llama.cpp (docs/engine.md, "Export").

A converted model becomes the `recurformer` architecture of the patched llama.cpp; an
original Llama / Qwen2 / Mistral model becomes llama.cpp's own architecture for it
(`llama`, `qwen2`), so that both sides of a comparison come from one command. The work is
done by the engine's converter, `<engine>/llama.cpp/convert_hf_to_gguf.py` (with the
engine's `gguf-py` first on the path), run as a subprocess of this Python; the engine is
`$RECURFORMER_ENGINE`, default `.engine` in the repository (`make engine` lays it out).

Everything the converter would refuse late is checked here first, each as one line: the
output type, the engine, the model (a folder that is not a model, an architecture or mixer
kind the file cannot represent), the output's place. The GGUF is written beside `--out`
under a staging name and renamed into place, so a failed or killed export leaves nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .checks import check_model_folder, read_json_object, weight_files
from .config import ConfigError, ReplacementSpec
from .errors import RecurformerError
from .files import atomic_file, sweep_staging
from .hub import locate, resolve_model
from .loading import RECURFORMER_TYPE, TOKENIZER_FILES, check_convertible, is_converted
from .mixers import MixerConfig
from .modeling import check_architecture
from .outputs import check_output

ENGINE_ENV = "RECURFORMER_ENGINE"
DEFAULT_ENGINE = Path(__file__).resolve().parents[2] / ".engine"  # the repository's, where `make engine` builds
TYPES = ("f32", "f16", "q8_0")
DEFAULT_TYPE = "f16"
# what the GGUF of a converted model can hold (docs/engine.md); the converter refuses the others too
EXPORT_KINDS = ("window+mamba2", "window", "mamba2")
# bytes written per byte of the checkpoint, at most (a bf16 checkpoint doubles in f32)
GROWTH = {"f32": 2.0, "f16": 1.0, "q8_0": 1.0}


class ExportError(RecurformerError, RuntimeError):
    """The engine is missing, or its converter failed on the model."""


@dataclass(frozen=True)
class Engine:
    """The engine's source tree: its converter and the `gguf` package beside it."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.source / "gguf-py"


def engine_root() -> Path:
    """Where the engine is: `$RECURFORMER_ENGINE`, else the repository's `.engine`."""
    return Path(os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE).expanduser()


def find_engine() -> Engine:
    """The engine, its source checked to be the patched one; one line if it is not there."""
    engine = Engine(engine_root())
    if not engine.converter.is_file() or not engine.gguf_py.is_dir():
        raise ExportError(f"no engine at {engine.root} (no llama.cpp/convert_hf_to_gguf.py): run `make engine` first "
                          f"(or point {ENGINE_ENV} at a folder holding the patched llama.cpp/)")
    if not (engine.source / "conversion" / "recurformer.py").is_file():
        raise ExportError(f"the llama.cpp at {engine.source} is not patched for recurformer: run `make engine` first")
    return engine


def check_type(out_type: str) -> str:
    if out_type not in TYPES:
        raise ConfigError(f"--type: unknown {out_type!r}; choose one of {', '.join(TYPES)}")
    return out_type


def active_sliding_window(text: dict) -> int | None:
    """The base model's sliding window if any of its layers uses one (Mistral; Qwen2 with
    `use_sliding_window`), else None; `text`: the base config as a dict."""
    window, layer_types = text.get("sliding_window"), text.get("layer_types")
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    if text.get("model_type") == "qwen2" and not text.get("use_sliding_window", False):
        return None
    return window


def check_exportable_base(text: dict, name: str) -> None:
    """Refuse a base model (`text`: its config as a dict) of an architecture `convert` does
    not take, or whose attention the GGUF would compute otherwise: an active sliding window
    (the engine's `llama`, `qwen2` and `recurformer` run full attention)."""
    check_architecture(text.get("model_type"))
    window = active_sliding_window(text)
    if window is not None:
        raise ConfigError(f"{name}: its sliding window ({window} tokens) cannot be exported: the engine runs full "
                          "attention; only base models without an active sliding window export")


def check_exportable_conversion(config: dict, name: str) -> None:
    """Refuse a converted model the `recurformer` GGUF cannot represent (docs/engine.md);
    `config`: its config.json as a dict."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{name}: its config.json has no text_config")
    check_exportable_base(text, name)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ConfigError(f"{name}: RoPE scaling ({rope_type}) cannot be exported: the recurformer architecture has "
                          "plain RoPE only")
    spec = ReplacementSpec.from_dict(config.get("replacement") or {})
    if (spec.num_layers, spec.num_kv_heads) != (text.get("num_hidden_layers"), text.get("num_key_value_heads")):
        raise ConfigError(f"{name}: its replacement spec is for {spec.num_layers} layers x {spec.num_kv_heads} KV heads, "
                          f"the model has {text.get('num_hidden_layers')} x {text.get('num_key_value_heads')}")
    mixer = MixerConfig.from_dict(config.get("mixer") or {})
    if mixer.kind not in EXPORT_KINDS:
        raise ConfigError(f"{name}: mixer kind {mixer.kind} cannot be exported; the engine runs "
                          f"{', '.join(EXPORT_KINDS)}")
    if mixer.kind != "window" and not mixer.ssd_norm:
        raise ConfigError(f"{name}: a Mamba-2 tail without its gated RMSNorm (ssd_norm false) cannot be exported")
    if mixer.kind != "window" and mixer.proj_bias:
        raise ConfigError(f"{name}: a Mamba-2 tail with projection biases (proj_bias true) cannot be exported")
    if not mixer.resolved:
        raise ConfigError(f"{name}: its mixer's window or state size is still 'auto'; convert it again")


def converter_command(engine: Engine, directory: Path, outfile: Path, out_type: str) -> list[str]:
    """The converter's command line (tests wrap it)."""
    return [sys.executable, str(engine.converter), str(directory), "--outfile", str(outfile), "--outtype", out_type]


def converter_environment(engine: Engine) -> dict[str, str]:
    """This environment with the engine's `gguf-py` first on the path, ahead of an installed `gguf`."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join([str(engine.gguf_py), *filter(None, [env.get("PYTHONPATH")])])
    return env


def failure_line(output: str) -> str:
    """The line that says why the converter failed: its last `ERROR` line, else the last line
    (an exception's)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.split(":", 2)[-1].strip() for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1]
    if len(lines) >= 2 and ":" not in lines[-1]:  # an exception without a message: the line that raised it
        return f"{lines[-1]} at {lines[-2]}"
    return lines[-1] if lines else "no output"


def gguf_architecture(config: dict) -> str:
    """The llama.cpp architecture a model exports to."""
    if config.get("model_type") == RECURFORMER_TYPE:
        return "recurformer"
    return {"mistral": "llama"}.get(config.get("model_type"), config.get("model_type"))


def export_command(model: str, out: str, out_type: str = DEFAULT_TYPE) -> dict:
    """Write `model` (a converted folder, or an original model as `convert` takes it: a
    folder, a known name, a hub id) as the GGUF file `out` in `out_type` (f32, f16, q8_0).
    Returns what was written."""
    check_type(out_type)
    if "{" in Path(out).name or "}" in Path(out).name:
        raise ConfigError(f"--out {out}: a name with braces would be read as a template by the converter; rename it")
    engine = find_engine()
    located = locate(model)  # a folder that is not a model, an unknown name: one line, before anything else
    converted = isinstance(located, Path) and is_converted(located)
    if not converted:
        check_convertible(model)  # the architecture, when the model is at hand, before anything is fetched
    directory = resolve_model(model)
    check_model_folder(directory)
    config = read_json_object(directory / "config.json", "config")
    if converted:
        check_exportable_conversion(config, str(model))
    else:
        check_exportable_base(config, str(model))
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{model}: no tokenizer files beside the model; the GGUF carries the tokenizer, so save it "
                          f"there first: tokenizer.save_pretrained('{directory}')")
    size = sum(path.stat().st_size for path in weight_files(directory))
    check_output(out, [directory], int(GROWTH[out_type] * size), folder=False)
    out_path = Path(out)
    sweep_staging(out_path.parent)  # what an export that was killed left
    with atomic_file(out_path) as staging:
        done = subprocess.run(converter_command(engine, directory, staging, out_type), env=converter_environment(engine),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0 or staging.stat().st_size == 0:
            raise ExportError(f"the converter failed on {model}: {failure_line(done.stdout)}")
    return {"model": str(model), "out": str(out_path), "architecture": gguf_architecture(config), "type": out_type,
            "bytes": out_path.stat().st_size}
