"""One set of defaults: what the library does without arguments is what the commands and
`recurformer run` do without flags (the best-measured choices; the paper's `mamba` and
`recency` are one argument away)."""

import pytest
from tiny_models import spec_for, tiny_model
from transformers import LlamaConfig

from recurformer import HeadScores, MixerConfig, convert, make_scorer, select_heads
from recurformer.cli import MIXER_FLAGS, build, build_parser
from recurformer.mixers import resolve_for_model
from recurformer.run import RunConfig
from recurformer.scoring import SelectionConfig

SMOLLM2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


@pytest.fixture
def texts(tmp_path):
    train, held_out = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("the quick brown fox . " * 20)
    held_out.write_text("a fixed size state . " * 20)
    return [str(train)], [str(held_out)]


def parsed(*argv):
    return build_parser().parse_args([str(a) for a in argv])


def test_convert_without_flags_builds_the_librarys_default_mixer():
    args = parsed("convert", "model", "--scores", "s.json", "--out", "o")
    mixer = MixerConfig.from_flags(args.kind or MixerConfig.kind, **{name: getattr(args, name) for name in MIXER_FLAGS})
    assert mixer == MixerConfig()
    assert MixerConfig().kind == "window+mamba2"  # the measured default; `mamba` is the paper's
    assert build(SelectionConfig, args) == SelectionConfig()


def test_analyze_and_convert_select_with_the_librarys_scorer():
    for command in (("analyze", "model", "--data", "d.txt", "--out", "s.json"),
                    ("convert", "model", "--scores", "s.json", "--out", "o")):
        assert build(SelectionConfig, parsed(*command)).scorer == SelectionConfig.scorer == "ablation"
    # 2 layers x 2 KV groups of 2 heads: recency would replace (0, 0) and (1, 1), ablation costs (0, 1) and (1, 0)
    scores = HeadScores("toy", 2, 4, 2, 16, [16], 1, 32, heads={"rr_16": [[0.9, 0.9, 0.1, 0.1], [0.2, 0.2, 0.8, 0.8]]},
                        groups={"ablation": [[0.5, 0.01], [0.02, 0.3]]})
    assert select_heads(scores, 0.5).source["scorer"] == SelectionConfig.scorer
    assert select_heads(scores, 0.5).groups == SelectionConfig(beta=0.5).select(scores).groups
    assert select_heads(scores, 0.5, make_scorer("recency")).groups != select_heads(scores, 0.5).groups


def test_run_without_flags_converts_like_the_library(texts):
    train, held_out = texts
    config = build(RunConfig, parsed("run", "--data", *train, "--eval-data", *held_out, "--out", "r"))
    assert config.mixer == MixerConfig.kind and config.beta == SelectionConfig.beta
    assert config.scorer == SelectionConfig.scorer and config.mixer_config() == MixerConfig()
    decided = config.for_model(SMOLLM2).mixer_config()
    assert decided == resolve_for_model(MixerConfig(), SMOLLM2)
    assert (decided.window, decided.sinks, decided.ssd_state) == (141, 4, 16)  # SmolLM2's measured shape


def test_the_library_converts_to_the_default_shape_of_the_models_heads():
    model = tiny_model("llama")
    converted = convert(model, spec_for(model, 0.5))
    assert MixerConfig.from_dict(converted.config.mixer) == resolve_for_model(MixerConfig(), model.config)
