"""Finding and reading a draft head's files: a built-in head (shipped in the package), a
folder or a Hugging Face repo id; its config.json and its tensors.

Heads are published as a config.json and one weights file: ``pytorch_model.bin`` (EAGLE,
EAGLE-3), ``medusa_lm_head.pt`` (Medusa) or ``*.safetensors``. Safetensors are preferred when
both are present. A pickle (``.bin``, ``.pt``) is opened with ``torch.load(weights_only=True)``
only: it may hold tensors and plain containers, never code, so a file that needs more is
refused rather than trusted. Every failure is a ``ModelLoadError`` that names the file and what
to do. What the tensors mean is for ``localspec.drafters.head_layouts``.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from localspec.config import BUILTIN_HEADS
from localspec.errors import ModelLoadError
from localspec.files import parse_json, read_user_text
from localspec.presets import builtin_head_folder

HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.pt"]
MAX_CONFIG_BYTES = 2**20  # a config.json is a few dozen settings


@dataclass(frozen=True)
class HeadFiles:
    """A head's config (empty when it has no config.json) and tensors, by checkpoint key."""

    name: str  # as the preset gives it
    folder: Path
    config: dict[str, object]
    tensors: dict[str, torch.Tensor]
    files: tuple[Path, ...]  # the weight files read

    @property
    def where(self) -> str:
        """The files, for messages."""
        return ", ".join(str(path) for path in self.files)


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_head(name: str) -> Path:
    """The local folder of head ``name``: a built-in head, a folder, or a Hub repo's snapshot
    (the cache, or a download when online)."""
    if name in BUILTIN_HEADS:
        folder = builtin_head_folder(name)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"built-in draft head '{name}' is missing from this install "
                                 f"({folder}): reinstall LocalSpec (pip install -e .)")
        return folder
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"draft head '{name}' is a file: point [speculative_config] model "
                             "at the folder that holds it and its config.json")
    if not _looks_like_repo_id(name):
        raise ModelLoadError(f"draft head '{name}' not found: not an existing folder nor a "
                             "Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"draft head '{name}' is not in the Hugging Face cache and cannot be downloaded now "
            f"(offline?). Download it once with internet (hf download {name}), or point "
            f"[speculative_config] model at a local folder. ({exc.__class__.__name__})"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"could not fetch draft head '{name}' from the Hugging Face Hub: "
                             f"{exc}") from exc


def read_config(folder: Path) -> dict[str, object]:
    """config.json as a dict; {} when there is none (Medusa heads can do without)."""
    path = folder / "config.json"
    if not path.is_file():
        return {}
    text = read_user_text(path, "head's config.json", limit=MAX_CONFIG_BYTES, error=ModelLoadError)
    data = parse_json(text, str(path), ModelLoadError)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object of settings")
    return data


def load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a pickle checkpoint, read with ``weights_only=True``; refused otherwise."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page long; its "WeightsUnpickler error: ..." sentence says what
        found = re.search(r"WeightsUnpickler error: ([^.]*)", str(exc))
        reason = found.group(1) if found else type(exc).__name__
        raise ModelLoadError(
            f"{path} is a pickle that needs more than tensors to load ({reason}). LocalSpec "
            "opens pickles with weights_only=True only, since anything more can run code. Use "
            "a safetensors copy of this head, or convert it with a tool you trust"
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path} (damaged or not a PyTorch checkpoint): "
                             f"{exc}. Fix: download or copy it again") from exc
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
        raise ModelLoadError(f"{path} is not a state dict (a mapping of names to tensors)")
    return data


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"cannot read {path} ({path.stat().st_size:,} bytes; damaged or "
                             f"incomplete?): {exc}. Fix: download or copy it again") from exc


def read_head(name: str) -> HeadFiles:
    """Resolve ``name`` and read its config and every weights file of one format."""
    folder = resolve_head(name)
    files = sorted(folder.glob("*.safetensors"))
    loader = load_safetensors
    if not files:
        files = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
        loader = load_pickle
    if not files:
        raise ModelLoadError(f"draft head '{name}': {folder} holds no weights (*.safetensors, "
                             "pytorch_model.bin or medusa_lm_head.pt)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(loader(path))
    return HeadFiles(name, folder, read_config(folder), tensors, tuple(files))
