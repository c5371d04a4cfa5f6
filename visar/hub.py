"""Models by Hugging Face Hub name, through `huggingface_hub`: its downloads, cache and settings.

`visar.load("deepseek-community/Janus-Pro-1B")` fetches a repository's folder (`snapshot_download`);
an official preset (`visar.load("llamagen-gpt-b-c2i-256")`) fetches its released files
(`hf_hub_download`) from the repository its authors publish them in. Everything huggingface_hub
honours applies: its cache (`HF_HOME`, `HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (cache only), `HF_TOKEN`
for gated repositories, and `revision=` (a branch, tag or commit). visar writes nothing itself:
huggingface_hub downloads to temporary files and moves each one into the cache only when complete.

Every failure is one `VisarError` sentence that says what to do: a repository or revision that does
not exist, a file a repository lacks, a gated repository, or a file missing from the cache when
offline (naming `HF_HUB_OFFLINE` and the local-path form of the same load) or when the Hub does not
answer (said after one request, not after huggingface_hub's retries).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .errors import VisarError

# owner/name, as the Hub spells repository ids (letters, digits, '-', '_', '.').
HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

# Original-format repositories whose transformers conversion (the format visar reads) is published
# under another id: a load by the original name fetches the conversion.
CONVERTED = {
    "deepseek-ai/Janus-Pro-1B": "deepseek-community/Janus-Pro-1B",
    "deepseek-ai/Janus-Pro-7B": "deepseek-community/Janus-Pro-7B",
    "BAAI/Emu3-Gen": "BAAI/Emu3-Gen-hf",
}

# What a folder load never needs: pictures for the model card, and half-precision copies of weights
# (diffusers' "fp16" variants) beside the full-precision files visar reads.
FOLDER_IGNORE = ["*.png", "*.jpg", "*.jpeg", "*.gif", "*.webp", "*.mp4", "*.fp16.*", "*.md"]
FOLDER_CONFIGS = ("config.json", "model_index.json")


class LocalForm(NamedTuple):
    """The same load from files on disk, as the Python API writes it and as the command line does."""

    api: str
    cli: str


def either_form(local_form: LocalForm | str) -> LocalForm:
    """A local form given once (words both interfaces read the same) or in both forms."""
    return local_form if isinstance(local_form, LocalForm) else LocalForm(local_form, local_form)


def said_both_ways(sentence: Callable[[str], str], local_form: LocalForm) -> VisarError:
    """sentence(local form) in the Python API's words, carrying the command line's (`VisarError.cli`)."""
    return VisarError(sentence(local_form.api), cli=sentence(local_form.cli))


def is_hub_name(name: str) -> bool:
    """owner/name that is not a path on this machine."""
    return bool(HUB_NAME.fullmatch(name)) and not Path(name).exists()


def hub_module():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # submodules the package imports lazily
        import huggingface_hub.errors  # noqa: F401
    except ImportError as err:
        raise VisarError("models by Hub name need huggingface_hub: pip install 'huggingface_hub>=1.32,<3'") from err
    return huggingface_hub


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    return value.upper() in ("1", "ON", "YES", "TRUE") or bool(hub_module().is_offline_mode())


def cache_dir() -> str:
    """The cache huggingface_hub uses now: HF_HUB_CACHE, else HF_HOME/hub, else its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return hub_module().constants.HF_HUB_CACHE


def explain(
    err: Exception, repo_id: str, filename: str | None, revision: str | None, local_form: LocalForm
) -> VisarError:
    """One sentence for a huggingface_hub failure; local_form: the same load from files on disk."""
    errors = hub_module().errors
    where = f"{repo_id}@{revision}" if revision else repo_id
    what = f"{filename} of {where}" if filename else where
    if isinstance(err, errors.GatedRepoError):
        return said_both_ways(
            lambda local: (
                f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id} and log in "
                f"(`hf auth login` or HF_TOKEN), or download it yourself and load {local}"
            ),
            local_form,
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        here = "" if filename else f", and no folder {repo_id} on this machine"
        return VisarError(
            f"no Hub repository {repo_id!r} (or it is private: log in with `hf auth login` or HF_TOKEN){here}; check "
            "the name, or see `visar models` for the names visar knows"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        ask = f"{repo_id} has no revision {revision!r}: pass an existing branch, tag or commit as"
        return VisarError(f"{ask} revision=", cli=f"{ask} --revision")
    if isinstance(err, errors.LocalEntryNotFoundError):
        if offline():
            return said_both_ways(
                lambda local: (
                    f"{what} is not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE is set: "
                    f"unset HF_HUB_OFFLINE to download it, or load {local}"
                ),
                local_form,
            )
        return unreachable(what, local_form)
    if isinstance(err, (errors.EntryNotFoundError, errors.RemoteEntryNotFoundError)):
        return said_both_ways(
            lambda local: f"{where} has no file {filename}: check the repository's files, or load {local}", local_form
        )
    return VisarError(f"fetching {what} from the Hugging Face Hub failed ({type(err).__name__}: {err})")


def unreachable(what: str, local_form: LocalForm) -> VisarError:
    return said_both_ways(
        lambda local: (
            f"cannot reach the Hugging Face Hub and {what} is not in the cache ({cache_dir()}): connect "
            f"and retry, or load {local}"
        ),
        local_form,
    )


def hub_answers(repo_id: str, filename: str, revision: str | None) -> bool:
    """Whether the Hub answers one request for the file's metadata, made without retries.

    huggingface_hub retries a download whose file is not cached five times over about 24 s before it
    says the Hub cannot be reached, printing each retry; one request that gets no answer says the
    same at once. Any answer counts (a missing repository, revision or file too): the download that
    follows says which."""
    hub = hub_module()
    try:
        hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, filename, revision=revision))
    except (hub.errors.HfHubHTTPError, hub.errors.HFValidationError):
        return True
    except Exception:  # the transport's own errors (httpx's or httpx2's, by huggingface_hub version): no answer
        return False
    return True


def fetch_file(repo_id: str, filename: str, revision: str | None = None, local_form: LocalForm | str = "") -> Path:
    """One file of a Hub repository, from huggingface_hub's cache (downloaded first unless offline).
    A file not cached yet is fetched only after one quick request finds the Hub answering (`hub_answers`).
    local_form: the same load from files on disk, for the messages (in both interfaces' words, or one)."""
    hub = hub_module()
    local_form = either_form(local_form or f"the file itself ({filename}) by path")
    if not offline() and not isinstance(cached_file(repo_id, filename, revision), str):
        if not hub_answers(repo_id, filename, revision):
            where = f"{repo_id}@{revision}" if revision else repo_id
            raise unreachable(f"{filename} of {where}", local_form)
    try:
        path = hub.hf_hub_download(
            repo_id, filename, revision=revision, cache_dir=cache_dir(), local_files_only=offline()
        )
    except (OSError, hub.errors.EntryNotFoundError, hub.errors.HFValidationError) as err:
        raise explain(err, repo_id, filename, revision, local_form) from err
    return Path(path)


def cached_file(repo_id: str, filename: str, revision: str | None):
    """The cached file's path (a str), or what huggingface_hub says of it otherwise (None: unknown)."""
    return hub_module().try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir(), revision=revision)


def fetch_folder(repo_id: str, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A Hub repository holding a model folder (transformers, diffusers or visar's), from the cache.

    Online, its config.json (or model_index.json, a diffusers pipeline) comes first, so that a
    repository of loose checkpoint files is refused before anything large is fetched; then the
    folder's files (those matching allow_patterns when given). Offline, the cached snapshot of that
    revision.
    """
    hub = hub_module()
    repo_id = CONVERTED.get(repo_id, repo_id)
    local_form = LocalForm("its folder by path: visar.load(FOLDER)", "its folder by path: --model FOLDER")
    if not offline():
        for config in FOLDER_CONFIGS:
            try:
                fetch_file(repo_id, config, revision, local_form)
                break
            except VisarError as err:
                cause = err.__cause__
                if isinstance(cause, hub.errors.RepositoryNotFoundError) and not isinstance(
                    cause, hub.errors.GatedRepoError
                ):  # said of the repository, not of its config.json
                    raise explain(cause, repo_id, None, revision, local_form) from cause
                if not isinstance(cause, hub.errors.RemoteEntryNotFoundError):
                    raise
        else:
            raise not_a_folder(repo_id)
    try:
        folder = hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir(),
            ignore_patterns=FOLDER_IGNORE,
            allow_patterns=allow_patterns,
            local_files_only=offline(),
        )
    except (OSError, hub.errors.EntryNotFoundError, hub.errors.HFValidationError) as err:
        raise explain(err, repo_id, None, revision, local_form) from err
    folder = Path(folder)
    if not any((folder / config).is_file() for config in FOLDER_CONFIGS):
        raise not_a_folder(repo_id)
    return folder


def not_a_folder(repo_id: str) -> VisarError:
    return VisarError(
        f"{repo_id} holds no model folder (no config.json nor model_index.json at its top): for released "
        "checkpoint files load the preset that names them (`visar models`), e.g. llamagen-gpt-b-c2i-256"
    )
