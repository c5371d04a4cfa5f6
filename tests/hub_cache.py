"""A Hugging Face Hub cache laid out on disk as huggingface_hub writes it, for offline loads by Hub name.

<cache>/models--<owner>--<name>/blobs/<sha256> holds each file's bytes, snapshots/<commit>/<path> is a
relative symlink to its blob, refs/<revision> holds the commit: what `hf_hub_download` and
`snapshot_download` leave behind, and what they read with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(repo_id: str, revision: str) -> str:
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()  # 40 hex digits, as a git commit


def lay_out(cache: Path, repo_id: str, files: dict[str, Path | bytes], revision: str = "main") -> Path:
    """Put `files` (path in the repository -> a file to copy, or bytes) in the cache as revision
    `revision` of `repo_id`; returns the snapshot folder."""
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    commit = commit_of(repo_id, revision)
    snapshot = repo / "snapshots" / commit
    for relative, content in files.items():
        data = content if isinstance(content, bytes) else Path(content).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def lay_out_folder(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """Every file under `folder` (a save_pretrained folder) as the repository's files."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return lay_out(cache, repo_id, files, revision)


def lay_out_files(cache: Path, repo_id: str, folder: Path, names: list[str], revision: str = "main") -> Path:
    """The files `names` of `folder` (a release folder holding more than one repository's files) as
    the repository's files, each under its own name."""
    return lay_out(cache, repo_id, {name: Path(folder) / name for name in names}, revision)


def listing(cache: Path) -> list[str]:
    """Every path under the cache, to check that a failed load wrote nothing."""
    return sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*"))
