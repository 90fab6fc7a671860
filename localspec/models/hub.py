"""Downloading a model from the Hugging Face Hub into the models folder, resumably.

Everything goes through ``huggingface_hub``'s own client: the repo's file listing with sizes
(``HfApi.model_info(files_metadata=True)``), each file's metadata (``get_hf_file_metadata``:
ETag, size, where to fetch it) and the transfer itself (``http_get``: its HTTP session, token,
retries, a ``Range`` request that continues a dropped connection, and its tqdm progress bar).
``HF_ENDPOINT`` (``huggingface_hub.constants.ENDPOINT``) says which Hub, ``HF_HUB_OFFLINE``
forbids the network, and a gated repo's token comes from ``hf auth login`` or ``HF_TOKEN``.

Why not ``snapshot_download(local_dir=...)``: huggingface_hub 2.4 writes each file to a
temporary name unique to the process and deletes it whenever the download fails (a killed
process leaves it behind under a name no later run reads), so a download stopped by Ctrl-C, a
closed laptop or a connection that stays down starts again from byte zero; a 4 GB GGUF
deserves better. Here each file grows in
``<models>/.downloads/<org>--<name>/<file>.incomplete``, opened for appending, and a later
``models add`` of the same repo asks for the rest with a ``Range`` header (the repo's commit
and each file's ETag are kept beside it: a repo that changed in between starts over).

Nothing is half-added: the whole plan is checked before the first byte (the repo exists and is
not gated, the pattern matches model files, the free disk holds what is left to fetch), the
files are checked as a model once they are all there (``describe.check_model``), and only then
are they moved into ``<models>/<org>/<name>/``, where the library finds them. Every failure is
a ``ModelLoadError`` with one line saying what to do.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localspec.config import models_root
from localspec.errors import LocalSpecError, ModelLoadError
from localspec.models.describe import check_model
from localspec.models.library import DOWNLOADS_FOLDER

# A save_pretrained model's files on the Hub (safetensors only: pickles are never fetched).
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
DOWNLOAD_FREE_MARGIN = 256 * 2**20  # free disk a download leaves besides its files
PLAN_FILE = "download.json"  # in the staging folder: the repo, its commit and the files' ETags
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
Log = Callable[[str], None]


def looks_like_repo_id(text: str) -> bool:
    """``org/name`` as the Hub spells repo ids (not a path that happens to hold one slash)."""
    return bool(_REPO_ID.match(text)) and ".." not in text and not text.endswith(".gguf")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int


@dataclass(frozen=True)
class Plan:
    """What a download will fetch, decided before the first byte."""

    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]
    gguf: bool  # GGUF files (each its own model) rather than one model folder
    destination: Path  # <models>/<org>/<name>

    @property
    def staging(self) -> Path:
        return self.destination.parents[1] / DOWNLOADS_FOLDER / self.repo_id.replace("/", "--")

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    def results(self) -> list[Path]:
        """The library's new entries: the folder, or each GGUF file."""
        if not self.gguf:
            return [self.destination]
        return [self.destination / f.name for f in self.files if f.name.endswith(".gguf")]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _hub_error(exc: Exception, repo_id: str, endpoint: str, revision: str | None = None
               ) -> ModelLoadError:
    """One line for what the Hub (or the way to it) answered."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{repo_id} is gated: accept its terms at {endpoint}/{repo_id} and "
                              "log in (`hf auth login`, or set HF_TOKEN), then add it again")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(f"no repo {repo_id} on the Hub ({endpoint}); check the spelling "
                              "(org/name), or log in if it is private")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{repo_id} has no revision '{revision or 'main'}' (a branch, tag "
                              "or commit of the repo)")
    if isinstance(exc, OfflineModeIsEnabled):
        return ModelLoadError(f"cannot download {repo_id}: HF_HUB_OFFLINE is set; unset it to "
                              "download, or add a model that is on this machine by its path")
    if isinstance(exc, httpx2.TransportError | LocalEntryNotFoundError | TimeoutError):
        return ModelLoadError(f"cannot reach the Hub at {endpoint} to download {repo_id} "
                              f"(offline? {type(exc).__name__}); connect and try again")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return ModelLoadError(f"the Hub answered {status} for {repo_id}: "
                              f"{str(exc).splitlines()[0]}")
    return ModelLoadError(f"downloading {repo_id} failed: {exc}")


def _hub_errors() -> tuple[type[Exception], ...]:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    return (HfHubHTTPError, httpx2.TransportError, LocalEntryNotFoundError, TimeoutError)


def _choose(repo_id: str, files: list[RemoteFile], include: list[str] | None
            ) -> tuple[list[RemoteFile], bool]:
    """The files to fetch and whether they are GGUF files; ModelLoadError when the repo (or
    the pattern) gives no model."""
    from huggingface_hub.utils import filter_repo_objects

    names = [f.name for f in files]
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    listing = ", ".join(f"{f.name} ({_size(f.size)})" for f in (ggufs or files)[:12])
    if include:
        chosen = list(filter_repo_objects(files, allow_patterns=include, key=lambda f: f.name))
        if not chosen:
            raise ModelLoadError(f"no file of {repo_id} matches {' '.join(include)}; it has "
                                 f"{listing}")
        if any(f.name.lower().endswith(".gguf") for f in chosen):
            return chosen, True
        chosen_names = {f.name for f in chosen}
        if "config.json" in chosen_names and any(n.endswith(".safetensors") for n in chosen_names):
            return chosen, False
        raise ModelLoadError(f"the files of {repo_id} matching {' '.join(include)} are not a "
                             "model (a .gguf, or config.json with *.safetensors): "
                             f"{', '.join(sorted(chosen_names))}")
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return list(filter_repo_objects(files, allow_patterns=list(MODEL_PATTERNS),
                                        key=lambda f: f.name)), False
    if len(ggufs) == 1:
        return ggufs, True
    if ggufs:
        raise ModelLoadError(f"{repo_id} holds {len(ggufs)} GGUF files; choose one with "
                             f"--include, e.g. --include '*Q4_K_M.gguf': {listing}")
    pickles = " (it has pickle weights only, which LocalSpec does not download)" if any(
        n.endswith(".bin") for n in names) else ""
    raise ModelLoadError(f"{repo_id} holds no model LocalSpec can run: no .gguf file and no "
                         f"config.json with *.safetensors{pickles}")


def plan_download(repo_id: str, include: list[str] | None = None, revision: str | None = None,
                  root: Path | None = None) -> Plan:
    """Ask the Hub what ``repo_id`` holds and decide what to fetch (no file is written)."""
    from huggingface_hub import HfApi, constants

    endpoint = constants.ENDPOINT
    if constants.is_offline_mode():
        raise ModelLoadError(f"cannot download {repo_id}: HF_HUB_OFFLINE is set; unset it to "
                             "download, or add a model that is on this machine by its path")
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision or "main",
                                                   files_metadata=True)
    except _hub_errors() as exc:
        raise _hub_error(exc, repo_id, endpoint, revision) from exc
    files = [RemoteFile(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    chosen, gguf = _choose(repo_id, files, include)
    destination = (root or models_root()) / repo_id
    return Plan(repo_id, str(info.sha), tuple(chosen), gguf, destination)


# ----------------------------------------------------------------------------- fetching


def _in_place(plan: Plan, f: RemoteFile) -> bool:
    path = plan.destination / f.name
    return path.is_file() and path.stat().st_size == f.size


def _have(plan: Plan) -> dict[str, int]:
    """Bytes of each file already here: staged whole, or a partial from an interrupted download
    of the same commit (a GGUF file already in place counts whole: each is a model of its own);
    the staging folder of another commit is removed."""
    staged = _read_plan_file(plan.staging)
    if staged is not None and staged.get("commit") != plan.commit:
        shutil.rmtree(plan.staging, ignore_errors=True)
    have = {}
    for f in plan.files:
        final, part = plan.staging / f.name, plan.staging / f"{f.name}.incomplete"
        if (plan.gguf and _in_place(plan, f)) or (final.is_file()
                                                   and final.stat().st_size == f.size):
            have[f.name] = f.size
        elif part.is_file() and part.stat().st_size <= f.size:
            have[f.name] = part.stat().st_size
        else:
            have[f.name] = 0
    return have


def _read_plan_file(staging: Path) -> dict[str, object] | None:
    try:
        data = json.loads((staging / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_space(plan: Plan, have: dict[str, int]) -> None:
    """ModelLoadError when the disk of the models folder cannot hold what is left to fetch
    (plus DOWNLOAD_FREE_MARGIN)."""
    need = plan.total - sum(have.values())
    probe = plan.destination
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + DOWNLOAD_FREE_MARGIN > free:
        raise ModelLoadError(f"not enough disk for {plan.repo_id}: {_size(need)} left to "
                             f"download (of {_size(plan.total)}) and {_size(DOWNLOAD_FREE_MARGIN)}"
                             f" to spare, but {probe} has {_size(free)} free; free some space or "
                             "set LOCALSPEC_MODELS to a folder on a larger disk")


def _fetch(plan: Plan, f: RemoteFile, tqdm_class: type | None) -> None:
    """One file into the staging folder, continuing its ``.incomplete`` part if there is one."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    final = plan.staging / f.name
    if final.is_file() and final.stat().st_size == f.size:
        return
    part = plan.staging / f"{f.name}.incomplete"
    part.parent.mkdir(parents=True, exist_ok=True)
    endpoint = constants.ENDPOINT
    url = hf_hub_url(plan.repo_id, f.name, revision=plan.commit, endpoint=endpoint)
    metadata = get_hf_file_metadata(url, endpoint=endpoint)
    etags = _read_plan_file(plan.staging) or {"repo": plan.repo_id, "commit": plan.commit}
    known = etags.setdefault("etags", {})
    if isinstance(known, dict) and known.get(f.name) not in (None, metadata.etag):
        part.unlink(missing_ok=True)  # the same name, other bytes: start this file over
    known[f.name] = metadata.etag  # type: ignore[index]
    (plan.staging / PLAN_FILE).write_text(json.dumps(etags), encoding="utf-8")
    size = metadata.size if metadata.size is not None else f.size
    resume = part.stat().st_size if part.is_file() else 0
    if resume > size:
        part.unlink()
        resume = 0
    with part.open("ab") as out:
        http_get(metadata.location, out, resume_size=resume, headers=build_hf_headers(),
                 expected_size=size, displayed_filename=f.name, tqdm_class=tqdm_class)
    part.replace(final)


def _install(plan: Plan) -> None:
    """Move the checked files from the staging folder to their place in the models folder."""
    (plan.staging / PLAN_FILE).unlink(missing_ok=True)
    if not plan.destination.exists() and not plan.gguf:
        plan.destination.parent.mkdir(parents=True, exist_ok=True)
        plan.staging.rename(plan.destination)
        _prune(plan.staging.parent)
        return
    for f in plan.files:
        if (plan.staging / f.name).is_file():
            target = plan.destination / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            (plan.staging / f.name).replace(target)
    shutil.rmtree(plan.staging, ignore_errors=True)
    _prune(plan.staging.parent)


def _prune(folder: Path) -> None:
    with contextlib.suppress(OSError):  # only an empty folder goes
        folder.rmdir()


def download(repo_id: str, include: list[str] | None = None, revision: str | None = None,
             tqdm_class: type | None = None, log: Log | None = None,
             root: Path | None = None) -> list[Path]:
    """Download ``repo_id`` (its ``include`` files, or the model it holds) into the models
    folder; the paths of the library's new entries. Continues an interrupted download of the
    same commit; ModelLoadError (one line, what to do) on every failure, with nothing added."""
    plan = plan_download(repo_id, include, revision, root)
    if all(_in_place(plan, f) for f in plan.files):
        if log is not None:
            log(f"{repo_id}: already downloaded, in {plan.destination}")
        return plan.results()
    have = _have(plan)
    check_space(plan, have)
    kept = sum(have.values())
    if log is not None:
        resumed = f", resuming with {_size(kept)} already here" if kept else ""
        log(f"downloading {len(plan.files)} file(s) of {repo_id} ({_size(plan.total)}) "
            f"to {plan.destination}{resumed}")
    try:
        plan.staging.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot write in the models folder {plan.staging.parents[1]}: "
                             f"{exc.strerror or exc}; set LOCALSPEC_MODELS to a folder of "
                             "yours") from exc
    for f in plan.files:
        if plan.gguf and _in_place(plan, f):
            continue
        try:
            _fetch(plan, f, tqdm_class)
        except _hub_errors() as exc:
            from huggingface_hub import constants

            error = _hub_error(exc, repo_id, constants.ENDPOINT)
            raise ModelLoadError(f"{error} (while fetching {f.name}; what arrived is kept: "
                                 "run the same command again to continue)") from exc
        except OSError as exc:  # the disk filled up, or a size that does not match
            raise ModelLoadError(f"downloading {f.name} of {repo_id} failed: {exc}; what "
                                 "arrived is kept: run the same command again to continue"
                                 ) from exc
    _check_staged(plan)
    _install(plan)
    return plan.results()


def _check_staged(plan: Plan) -> None:
    """The staged files must be a model that starts; if not they are removed (nothing is
    added) and the error says why."""
    try:
        if plan.gguf:
            for f in plan.files:
                if f.name.lower().endswith(".gguf") and (plan.staging / f.name).is_file():
                    check_model(plan.staging / f.name)
        else:
            check_model(plan.staging)
    except (LocalSpecError, OSError) as exc:
        shutil.rmtree(plan.staging, ignore_errors=True)
        _prune(plan.staging.parent)
        raise ModelLoadError(f"downloaded {plan.repo_id}, but it is not a model LocalSpec can "
                             f"run, so nothing was added: {exc}") from exc


def partial_bytes(repo_id: str, root: Path | None = None) -> int:
    """Bytes of an interrupted download of ``repo_id`` kept for the next attempt."""
    staging = (root or models_root()) / DOWNLOADS_FOLDER / repo_id.replace("/", "--")
    return sum(p.stat().st_size for p in staging.rglob("*") if p.is_file()) if staging.is_dir() \
        else 0
