"""`recurformer export` (docs/engine.md): tiny Llama, Qwen2 and Mistral conversions of each
exportable mixer kind written as GGUF through the engine's converter and read back with the
engine's own `gguf` reader: every key of the layout and every tensor equals the checkpoint's
(after the documented transforms: the gate folded into ssm_out, A = -exp(A_log)); original
models export to llama.cpp's own architectures; bad inputs are one line, exit 2, nothing
written. Skipped where the engine's source is not there (`make engine`)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks.gguf_converter_shim import unknown_tokenizer_converter
from safetensors.torch import load_file
from tiny_models import MIXERS, mixed_layout, open_gates, tiny_model, tiny_tokenizer

from recurformer import export
from recurformer.cli import main
from recurformer.mixers import MixerConfig
from recurformer.surgery import convert

ENGINE = export.Engine(export.engine_root())
KINDS = export.EXPORT_KINDS
LAYERS = 3

pytestmark = pytest.mark.skipif(not ENGINE.converter.is_file(), reason=f"no engine source at {ENGINE.source} (run "
                                f"`make engine`, or point {export.ENGINE_ENV} at a folder holding llama.cpp/)")


@pytest.fixture(autouse=True)
def tiny_tokenizers(request):
    """The converter run through `benchmarks/gguf_converter_shim.py`, which lets it take the tiny test
    tokenizers (a pre-tokenizer llama.cpp has no hash for is written as GPT-2's); the real
    model's is taken as it is."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    with unknown_tokenizer_converter():
        yield


@pytest.fixture(scope="module")
def gguf():
    """The engine's own `gguf` package (its gguf-py), not the one installed in the venv."""
    saved = {name: module for name, module in sys.modules.items() if name == "gguf" or name.startswith("gguf.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(ENGINE.gguf_py))
    try:
        module = importlib.import_module("gguf")
        assert Path(module.__file__).resolve().is_relative_to(ENGINE.gguf_py.resolve())
        assert hasattr(module.MODEL_ARCH, "RECURFORMER"), "the engine's gguf-py is not patched for recurformer"
    finally:
        sys.path.remove(str(ENGINE.gguf_py))
        for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return module


def base_model(arch: str, **overrides):
    """A tiny random model of `arch` with three layers."""
    # 128 tokens: room for the tiny tokenizer and the one special token Qwen2's tokenizer class adds to it
    return tiny_model(arch, num_hidden_layers=LAYERS, vocab_size=128, **overrides)


def save_converted(path: Path, arch: str, kind: str, mixer_fields: dict | None = None, **overrides) -> Path:
    model = base_model(arch, **overrides)
    mixer = MixerConfig(kind=kind, window=16, sinks=2, **(mixer_fields or {})) if kind in KINDS else MIXERS[kind]
    open_gates(convert(model, mixed_layout(model), mixer, init="random")).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_original(path: Path, arch: str, **overrides) -> Path:
    base_model(arch, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def expected_tensors(folder: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    """GGUF name -> (values in torch's layout, shape in ggml's order) of a converted folder, by docs/engine.md."""
    config = json.loads((folder / "config.json").read_text())
    text, kind = config["text_config"], config["mixer"]["kind"]
    weights = {name: t.float() for name, t in load_file(folder / "model.safetensors").items()}
    out = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = (tensor.numpy(), list(reversed(tensor.shape)))

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights:  # tied: llama.cpp reads token_embd, as for Llama
        put("output.weight", weights["lm_head.weight"])
    plain = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight",
             **{f"self_attn.{p}_proj.{s}": f"attn_{p}.{s}" for p in "qkv" for s in ("weight", "bias")}}
    window = {f"{p}_proj.{s}": f"attn_{p}_win.{s}" for p in "qkv" for s in ("weight", "bias")}
    tail = {"in_proj.weight": "ssm_in.weight", "conv_weight": "ssm_conv1d.weight", "conv_bias": "ssm_conv1d.bias",
            "dt_bias": "ssm_dt.bias", "norm_weight": "ssm_norm.weight", "out_proj.weight": "ssm_out.weight"}
    for layer in range(text["num_hidden_layers"]):
        prefix, blk = f"model.layers.{layer}.", f"blk.{layer}."
        for source, name in plain.items():
            if prefix + source in weights:
                put(blk + name, weights[prefix + source])
        mixer = prefix + "self_attn.mixer."
        if kind == "window+mamba2":
            window_prefix, tail_prefix = mixer + "window.", mixer + "recurrent."
        else:
            window_prefix = tail_prefix = mixer
        if kind != "mamba2":
            for source, name in window.items():
                if window_prefix + source in weights:
                    put(blk + name, weights[window_prefix + source])
        if kind != "window" and tail_prefix + "A_log" in weights:
            for source, name in tail.items():
                if tail_prefix + source in weights:
                    put(blk + name, weights[tail_prefix + source])
            put(blk + "ssm_a", -torch.exp(weights[tail_prefix + "A_log"])[:, None])
            put(blk + "ssm_d", weights[tail_prefix + "D"][:, None])
            if kind == "window+mamba2":  # out = window + gate * out_proj(y): the gate folded in
                gate = weights[mixer + "gate"]
                put(blk + "ssm_out.weight", gate[:, None] * weights[tail_prefix + "out_proj.weight"])
    return out


def test_a_tail_without_its_conv_bias_exports_without_the_tensor(tmp_path, gguf):
    folder = save_converted(tmp_path / "converted", "qwen2", "window+mamba2", dict(conv_bias=False))
    assert main(["export", str(folder), "--out", str(tmp_path / "m.gguf"), "--type", "f32"]) == 0
    want, got = expected_tensors(folder), {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert sorted(got) == sorted(want)
    assert "blk.0.ssm_conv1d.weight" in got and "blk.0.ssm_conv1d.bias" not in got
    for name, (values, _) in want.items():
        np.testing.assert_array_equal(np.asarray(got[name].data).reshape(values.shape), values, err_msg=name)


def test_a_tail_with_projection_biases_is_refused(tmp_path, capsys):
    folder = save_converted(tmp_path / "converted", "qwen2", "window+mamba2", dict(proj_bias=True))
    refused(capsys, ("export", folder, "--out", tmp_path / "m.gguf"), "projection biases (proj_bias true)")
    nothing_written(tmp_path, "converted")


@pytest.mark.parametrize("kind", KINDS)
def test_a_converted_model_exports_every_key_and_tensor_of_the_layout(tmp_path, arch, kind, gguf, capsys):
    folder = save_converted(tmp_path / "converted", arch, kind)
    assert main(["export", str(folder), "--out", str(tmp_path / "m.gguf"), "--type", "f32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "recurformer" and summary["type"] == "f32"
    assert [p.name for p in tmp_path.iterdir() if p.name != "converted"] == ["m.gguf"]  # no staging file left

    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    kv = fields(reader)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    group = text["num_attention_heads"] // text["num_key_value_heads"]
    groups = text["num_key_value_heads"]
    replaced = [groups, 1, 0]  # mixed_layout(): every group, one, none
    assert kv["general.architecture"] == "recurformer"
    r = "recurformer."
    assert kv[r + "attention.head_count"] == [(groups - n) * group for n in replaced]
    assert kv[r + "attention.head_count_kv"] == [groups - n for n in replaced]
    assert kv[r + "mixer.head_count"] == [n * group for n in replaced]
    assert kv[r + "mixer.head_count_kv"] == replaced
    expected = {"block_count": LAYERS, "context_length": text["max_position_embeddings"],
                "embedding_length": text["hidden_size"], "feed_forward_length": text["intermediate_size"],
                "vocab_size": text["vocab_size"], "attention.key_length": head_dim,
                "attention.value_length": head_dim, "rope.dimension_count": head_dim,
                "attention.sliding_window": 16 if kind != "mamba2" else 0,
                "attention.sliding_window_sinks": 2 if kind != "mamba2" else 0}
    assert {key: kv[r + key] for key in expected} == expected
    assert kv[r + "rope.freq_base"] == pytest.approx(text["rope_parameters"]["rope_theta"])
    assert kv[r + "attention.layer_norm_rms_epsilon"] == pytest.approx(text["rms_norm_eps"])
    ssm = {key: kv[r + key] for key in ("ssm.conv_kernel", "ssm.state_size", "ssm.inner_size", "ssm.group_count",
                                          "ssm.time_step_rank") if r + key in kv}
    if kind == "window":
        assert ssm == {}
    else:
        heads = groups * group  # the largest layer's replaced heads: layer 0's, all of them
        assert ssm == {"ssm.conv_kernel": 4, "ssm.state_size": config["mixer"]["ssd_state"],
                       "ssm.inner_size": heads * head_dim, "ssm.group_count": heads, "ssm.time_step_rank": heads}
    tokenizer = tiny_tokenizer()
    assert kv["tokenizer.ggml.model"] == "gpt2"
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == text["vocab_size"]
    assert tokens[:len(tokenizer)] == sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)

    want = expected_tensors(folder)
    got = {t.name: t for t in reader.tensors}
    assert sorted(got) == sorted(want)
    for name, (values, shape) in want.items():
        tensor = got[name]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert [int(n) for n in tensor.shape] == shape, name
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(values.shape), values, err_msg=name)
    # what docs/engine.md says of the shapes
    D, E = head_dim, text["hidden_size"]
    assert "blk.0.attn_q.weight" not in got and "blk.2.ssm_in.weight" not in got and "blk.2.attn_q_win.weight" not in got
    assert [int(n) for n in got["blk.1.attn_output.weight"].shape] == [groups * group * D, E]
    if kind != "mamba2":
        assert [int(n) for n in got["blk.0.attn_q_win.weight"].shape] == [E, groups * group * D]
        assert [int(n) for n in got["blk.1.attn_k_win.weight"].shape] == [E, D]
    if kind != "window":
        H, G, N = group, 1, config["mixer"]["ssd_state"]  # layer 1: one replaced group
        assert [int(n) for n in got["blk.1.ssm_in.weight"].shape] == [E, H * D + G * D + G * N + H * N + H]
        assert [int(n) for n in got["blk.1.ssm_conv1d.weight"].shape] == [4, G * D + G * N + H * N]
        assert [int(n) for n in got["blk.1.ssm_a"].shape] == [1, H]
        assert [int(n) for n in got["blk.1.ssm_out.weight"].shape] == [H * D, H * D]


def test_an_original_model_exports_to_llama_cpps_own_architecture(tmp_path, arch, gguf, capsys):
    folder = save_original(tmp_path / "original", arch)
    assert main(["export", str(folder), "--out", str(tmp_path / "o.gguf"), "--type", "f32"]) == 0
    name = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[arch]
    assert json.loads(capsys.readouterr().out)["architecture"] == name
    reader = gguf.GGUFReader(tmp_path / "o.gguf")
    assert fields(reader)["general.architecture"] == name
    assert fields(reader)[f"{name}.block_count"] == LAYERS
    assert {t.name for t in reader.tensors} >= {f"blk.{i}.attn_q.weight" for i in range(LAYERS)}


def test_f16_and_q8_0_keep_the_small_tensors_in_f32(tmp_path, gguf):
    # 64 channels: rows of whole q8_0 blocks (32), so the weights quantize rather than fall back to f16
    folder = save_converted(tmp_path / "converted", "llama", "window+mamba2", hidden_size=64, intermediate_size=128)
    want = expected_tensors(folder)
    F32, F16, Q8_0 = (gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "Q8_0"))
    for out_type, matrix_type, tolerance in (("f16", F16, 2e-3), ("q8_0", Q8_0, 2e-2)):
        assert main(["export", str(folder), "--out", str(tmp_path / f"{out_type}.gguf"), "--type", out_type]) == 0
        reader = gguf.GGUFReader(tmp_path / f"{out_type}.gguf")
        for tensor in reader.tensors:
            values = want[tensor.name][0]
            small = values.ndim == 1 or tensor.name.endswith(("_norm.weight", "ssm_a", "ssm_d", "ssm_conv1d.weight"))
            assert tensor.tensor_type == (F32 if small else matrix_type), tensor.name
            got = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(values.shape)
            scale = np.abs(values).max()
            np.testing.assert_allclose(got, values, atol=tolerance * scale, rtol=0, err_msg=tensor.name)


# --- refused: one line, exit 2, nothing written ------------------------------------------


def refused(capsys, argv, *needles) -> str:
    capsys.readouterr()  # what making the inputs printed
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("recurformer: error: "), err
    for needle in needles:
        assert str(needle) in err, err
    return err


def nothing_written(folder: Path, *kept: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)


def test_a_folder_that_is_not_a_model_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    refused(capsys, ("export", tmp_path / "empty", "--out", tmp_path / "m.gguf"), "has no config.json")
    nothing_written(tmp_path, "empty")


def test_an_unknown_type_is_refused(tmp_path, capsys):
    folder = save_original(tmp_path / "original", "llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(["export", str(folder), "--out", str(tmp_path / "m.gguf"), "--type", "q4_0"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--type: invalid choice: 'q4_0'" in err, err
    with pytest.raises(export.ConfigError, match="choose one of f32, f16, q8_0"):
        export.export_command(str(folder), str(tmp_path / "m.gguf"), "q4_0")
    nothing_written(tmp_path, "original")


def test_an_out_that_cannot_be_written_is_refused(tmp_path, capsys):
    folder = save_original(tmp_path / "original", "llama")
    refused(capsys, ("export", folder, "--out", "/proc/recurformer/m.gguf"), "cannot write there")
    (tmp_path / "a-file").write_text("")
    refused(capsys, ("export", folder, "--out", tmp_path / "a-file" / "m.gguf"), "is not a directory")
    refused(capsys, ("export", folder, "--out", tmp_path), "is a directory")
    nothing_written(tmp_path, "original", "a-file")


def test_an_engine_not_built_is_refused(tmp_path, capsys, monkeypatch):
    folder = save_original(tmp_path / "original", "llama")
    monkeypatch.setenv(export.ENGINE_ENV, str(tmp_path / "no-engine"))
    refused(capsys, ("export", folder, "--out", tmp_path / "m.gguf"), "run `make engine` first", tmp_path / "no-engine")
    nothing_written(tmp_path, "original")


@pytest.mark.parametrize("kind", ["mamba", "window+linear"])
def test_a_mixer_kind_the_engine_does_not_run_is_refused(tmp_path, capsys, kind):
    folder = save_converted(tmp_path / "converted", "llama", kind)
    refused(capsys, ("export", folder, "--out", tmp_path / "m.gguf"), f"mixer kind {kind} cannot be exported",
            "window+mamba2, window, mamba2")
    nothing_written(tmp_path, "converted")


def edit_config(folder: Path, change) -> Path:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_rope_scaling_and_a_sliding_window_are_refused(tmp_path, capsys):
    scaled = edit_config(save_converted(tmp_path / "scaled", "qwen2", "window"), lambda c: c["text_config"].update(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))
    refused(capsys, ("export", scaled, "--out", tmp_path / "m.gguf"), "RoPE scaling (linear)")
    sliding = save_original(tmp_path / "sliding", "mistral", sliding_window=8)
    refused(capsys, ("export", sliding, "--out", tmp_path / "m.gguf"), "sliding window (8 tokens)")
    converted = edit_config(save_converted(tmp_path / "converted", "mistral", "window"),
                            lambda c: c["text_config"].update(sliding_window=8))
    refused(capsys, ("export", converted, "--out", tmp_path / "m.gguf"), "sliding window (8 tokens)")
    nothing_written(tmp_path, "scaled", "sliding", "converted")


def run_converter(folder: Path, out: Path) -> subprocess.CompletedProcess:
    command = export.converter_command(ENGINE, folder, out, "f32")
    return subprocess.run(command, env=export.converter_environment(ENGINE), capture_output=True, text=True)


def test_the_converter_itself_refuses_what_it_cannot_represent(tmp_path):
    """The checks above, made again by the converter class, for whoever runs it directly: a
    ValueError that names the problem, as upstream's converters refuse (`recurformer export`
    shows its line alone: the tests above)."""
    cases = {
        "mamba": (save_converted(tmp_path / "mamba", "llama", "mamba"),
                  "mixer kind 'mamba' cannot be exported; supported kinds: window+mamba2, window, mamba2"),
        "rope": (edit_config(save_converted(tmp_path / "rope", "llama", "window+mamba2"), lambda c: c["text_config"].update(
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0})), "RoPE scaling (llama3)"),
        "sliding": (edit_config(save_converted(tmp_path / "sliding", "mistral", "mamba2"),
                                lambda c: c["text_config"].update(sliding_window=8)), "sliding window (8)"),
    }
    for folder, message in cases.values():
        done = run_converter(folder, tmp_path / "m.gguf")
        last = (done.stdout + done.stderr).strip().splitlines()[-1]
        assert done.returncode != 0 and last.startswith("ValueError: recurformer: ") and message in last, last
        assert not (tmp_path / "m.gguf").exists()


def test_a_converter_that_fails_leaves_nothing(tmp_path, capsys, monkeypatch):
    folder = save_original(tmp_path / "original", "llama")
    failing = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('half'); "
               "print('ERROR:hf-to-gguf:something broke'); sys.exit(1)"]
    monkeypatch.setattr(export, "converter_command", lambda engine, directory, outfile, out_type: [*failing, str(outfile)])
    refused(capsys, ("export", folder, "--out", tmp_path / "m.gguf"), "the converter failed on", "something broke")
    nothing_written(tmp_path, "original")


def test_the_engine_is_found_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.delenv(export.ENGINE_ENV, raising=False)
    assert export.engine_root() == export.DEFAULT_ENGINE
    assert export.DEFAULT_ENGINE == Path(__file__).resolve().parents[1] / ".engine"
    monkeypatch.setenv(export.ENGINE_ENV, str(tmp_path))
    assert export.engine_root() == tmp_path
    (tmp_path / "llama.cpp" / "gguf-py").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(export.ExportError, match="not patched for recurformer: run `make engine` first"):
        export.find_engine()
    env = export.converter_environment(export.Engine(tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "llama.cpp" / "gguf-py")


@pytest.mark.real_model
def test_the_real_model_and_its_conversion_export_with_its_own_tokenizer(tmp_path, gguf):
    """SmolLM2-135M: its BPE tokenizer recognized (`smollm`, no shim), the conversion's head
    counts those of its spec, and both sides the same vocabulary."""
    from tiny_models import spec_for

    from recurformer.loading import load_model

    model, tokenizer, _ = load_model("smollm2-135m", progress=False)
    spec = spec_for(model, 0.3)
    converted = open_gates(convert(model, spec))
    converted.save_pretrained(tmp_path / "converted")
    tokenizer.save_pretrained(tmp_path / "converted")
    assert main(["export", str(tmp_path / "converted"), "--out", str(tmp_path / "c.gguf"), "--type", "q8_0"]) == 0
    assert main(["export", "smollm2-135m", "--out", str(tmp_path / "o.gguf"), "--type", "q8_0"]) == 0
    hybrid, original = (fields(gguf.GGUFReader(tmp_path / name)) for name in ("c.gguf", "o.gguf"))
    assert (hybrid["general.architecture"], original["general.architecture"]) == ("recurformer", "llama")
    assert hybrid["tokenizer.ggml.pre"] == original["tokenizer.ggml.pre"] == "smollm"
    assert hybrid["tokenizer.ggml.tokens"] == original["tokenizer.ggml.tokens"]
    assert hybrid.get("tokenizer.chat_template") == original.get("tokenizer.chat_template")
    replaced = [len(spec.replaced_heads(layer)) for layer in range(30)]
    assert hybrid["recurformer.mixer.head_count_kv"] == replaced
    assert hybrid["recurformer.attention.head_count"] == [(3 - n) * 3 for n in replaced]
