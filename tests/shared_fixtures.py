"""Fixtures many test modules share (registered by conftest.py's ``pytest_plugins``): a cache
and other LocalSpec folders of the test's own, and the native kernels compiled once a session.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from kernel_helpers import kernel_cache, kernel_lib


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A LocalSpec cache of the test's own (LOCALSPEC_CACHE): conversions, packs, crash logs."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOCALSPEC_CACHE", str(cache))
    return cache


@pytest.fixture
def own_folders(own_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own cache, data and models folders and an empty Hugging Face cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path


@pytest.fixture(scope="session")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels the product would serve here, compiled once a session (kernel_helpers)."""
    return kernel_lib(tmp_path_factory)


@pytest.fixture(scope="session", params=["served", "portable"])
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels this machine serves, then the portable build: both must pass everything."""
    return kernel_lib(tmp_path_factory, None if request.param == "served" else "portable")


@pytest.fixture
def session_kernels(kernels: ctypes.CDLL, tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Path:
    """Models load with the session's kernels, however fresh the test's cache (no compile)."""
    from localspec.models import packed_store

    folder = kernel_cache(tmp_path_factory)
    monkeypatch.setattr(packed_store, "kernel_dir", lambda: folder)
    return folder
