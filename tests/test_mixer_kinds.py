"""The mixer kinds and `MixerConfig`: every kind can be built however the package is entered,
and each kind reads exactly the `MixerConfig` fields it declares (`Mixer.reads`)."""

import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch
from mixer_cases import CONFIGS, D_IN, HEADS, positions_for, rope

from recurformer.mixers import MIXERS, MixerConfig, ReplacedHeads, resolve_shape

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "recurformer"
FIELDS = {f.name for f in fields(MixerConfig)} - {"kind"}

# The package `recurformer` as an empty namespace: its `__init__` (which imports the mixers
# among everything else) does not run; only the module that defines `MixerConfig` is imported.
WITHOUT_PACKAGE_INIT = f"""
import importlib, sys, types
package = types.ModuleType("recurformer")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["recurformer"] = package
MixerConfig = importlib.import_module(sys.argv[1]).MixerConfig
for kind in sys.argv[2:]:
    MixerConfig(kind=kind)
print("built", len(sys.argv) - 2)
"""


def test_every_kind_is_built_without_the_package_init_importing_the_mixers():
    result = subprocess.run([sys.executable, "-c", WITHOUT_PACKAGE_INIT, MixerConfig.__module__, *MIXERS],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"built {len(MIXERS)}"


class Recording(MixerConfig):
    """A `MixerConfig` that notes which of its fields are read once `seen` is a set."""

    seen: set[str] | None = None

    def __getattribute__(self, name):
        seen = object.__getattribute__(self, "seen")
        if seen is not None and name in FIELDS:
            seen.add(name)
        return object.__getattribute__(self, name)


def fields_read(config: MixerConfig) -> set[str]:
    """The fields a mixer of `config` reads while it is built, initialized (both ways), run
    over a padded prefill and stepped one token (compiled where the kernels are built)."""
    recording = Recording(**asdict(resolve_shape(config, HEADS)))
    recording.seen = set()
    torch.manual_seed(0)
    mixer = MIXERS[config.kind](D_IN, HEADS, recording)
    mixer.reset_parameters()
    mixer.init_from_heads(ReplacedHeads(torch.randn(4, 8, D_IN), torch.randn(2, 8, D_IN), torch.randn(2, 8, D_IN),
                                        None, None, None, group_size=2))
    x, cos_sin = torch.randn(2, 9, D_IN), rope(positions_for(2, 9))
    with torch.no_grad():
        state = mixer.allocate_state(2, torch.float32, "cpu")
        mixer(x[:, :8], state, torch.tensor([[0] * 2 + [1] * 6, [1] * 8]), tuple(t[:, :8] for t in cos_sin))
        mixer.step(x[:, 8], state, tuple(t[:, 8:] for t in cos_sin))
    return recording.seen


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_each_kind_reads_the_fields_it_declares(case):
    config = CONFIGS[case]
    assert fields_read(config) == set(MIXERS[config.kind].reads)
