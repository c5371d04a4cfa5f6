"""The wheels visar's Hugging Face families need beyond the GPU machine's image, packed to travel with the
checkout; tools/device_check.sh installs them there before its first step.

    python3 tools/fetch_device_wheels.py [--python-version 3.12] [--out .device_wheels]

Run here, where pip reaches PyPI. The GPU machine reaches no package index, and its image had
transformers 5.17 (visar asks for >= 5.24: the Janus and Emu3 adapters failed on 5.17 at the first
loan) and no diffusers (aMUSEd) when last read (`IMAGE_VERSIONS`). The requirements are
pyproject.toml's `hf` extra and visar's huggingface_hub pin. One the image meets is left to it; the
rest are fetched for the machine's platform (manylinux x86_64, CPython --python-version) with `pip
download --no-deps --only-binary=:all:`, each at the lowest version its pin allows (the version the
pin was set on, and the one that asks least of the image: transformers 5.25 would want
huggingface_hub 2.4, its HTTP stack and `kernels` too); then, transitively, each requirement in
their Requires-Dist that the image may not meet (a package it lacks, or a bound on one whose
version was not recorded), at pip's newest version. --also NAME==VERSION adds one.

The wheels travel as one archive, OUT/wheels.tar.xz (their files, solidly compressed: about a
third of the wheels' own size, since visar's tracked files leave only ~10 MiB of the device tool's
64 MiB), with OUT/manifest.json; name the folder in the device call's `carry`. The script fails,
leaving no archive, when the archive would not fit beside the checkout that travels too (64 MiB
less the checkout's tracked and untracked-not-ignored files, less --headroom-mib for files added
before the call).

    python3 tools/fetch_device_wheels.py --install SITE [--out .device_wheels] [--for-fetched-platform]

On the GPU machine (tools/device_check.sh): rebuilds the wheels from the archive, installs them with
`pip install --no-deps --no-index --target SITE` (SITE then goes first on PYTHONPATH), and checks
each installed distribution's requirements against what this interpreter sees with SITE first; its
last line says what was installed and how many requirements are unmet (then it exits 3, installed
all the same; a failed install exits 1). --for-fetched-platform installs for the manifest's platform
and Python instead, unchecked (the CPU dry run: the archive installs).
"""

from __future__ import annotations

import argparse
import email.parser
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
ARCHIVE, MANIFEST = "wheels.tar.xz", "manifest.json"
UNMET_EXIT = 3  # --install: installed, but some requirement is unmet
DEVICE_TOOL_MIB = 64  # what one call of the device tool carries: the checkout and the carried folders

# Versions on the GPU machine's image as last read there (pip list, 2026-11; docs/history/SPEED-journal.md
# saw transformers 5.17 on the first loan); None: installed, version not recorded. A requirement is left
# to the image when this version meets it, or, with None, when it bounds no version.
IMAGE_VERSIONS: dict[str, str | None] = {
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "transformers": "5.17.0",
} | dict.fromkeys(
    "anyio certifi click filelock fsspec hf-xet httpx idna jinja2 packaging pillow psutil pyyaml regex requests "
    "tqdm typer typing-extensions zipp".split()
)

# manylinux tags pip matches exactly: glibc 2.17 (manylinux2014) up to the image's Ubuntu 24.04 (2.39)
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]


def pinned_requirements(pyproject: Path) -> list[Requirement]:
    """pyproject.toml's `hf` extra and the core dependency on huggingface_hub (their downloads' library)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    hub = [r for r in map(Requirement, project["dependencies"]) if canonicalize_name(r.name) == "huggingface-hub"]
    return [Requirement(r) for r in project["optional-dependencies"]["hf"]] + hub


def device_environment(python_version: str) -> dict[str, str]:
    """The marker environment of the device's CPython on linux x86_64."""
    return default_environment() | {
        "implementation_name": "cpython",
        "os_name": "posix",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_system": "Linux",
        "python_full_version": f"{python_version}.0",
        "python_version": python_version,
        "sys_platform": "linux",
    }


def image_meets(requirement: Requirement) -> bool:
    name = canonicalize_name(requirement.name)
    if name not in IMAGE_VERSIONS:
        return False
    version = IMAGE_VERSIONS[name]
    if version is None:
        return not requirement.specifier  # installed, but a bound may ask for more than it has
    return requirement.specifier.contains(version, prereleases=True)


def lowest_allowed(requirement: Requirement) -> str:
    """NAME==V at the lowest version the pin names (>=, ==, ~=), or the requirement itself (pip's newest)."""
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    if not floors:
        return str(requirement)
    return f"{requirement.name}=={max(floors)}"


def pip_download(spec: str, into: Path, python_version: str) -> Path:
    """One wheel, no dependencies, for the device's platform -> its path."""
    before = set(into.glob("*.whl"))
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation"]
    command += ["cp", "--python-version", python_version, *platforms, "-d", str(into), spec]
    done = subprocess.run(command, capture_output=True, text=True)
    new = set(into.glob("*.whl")) - before
    if done.returncode != 0 or len(new) != 1:
        raise SystemExit(f"pip download {spec} failed:\n{done.stderr.strip()[-2000:]}")
    return new.pop()


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist (with their markers)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        fields = email.parser.Parser().parsestr(zf.read(name).decode())
    return [Requirement(line) for line in fields.get_all("Requires-Dist") or []]


def needed(requirement: Requirement, environment: dict) -> bool:
    """A requirement of an install without extras on the device."""
    return requirement.marker is None or requirement.marker.evaluate(environment | {"extra": ""})


def fetch_wheels(roots: list[Requirement], into: Path, python_version: str) -> tuple[list[Path], list[str]]:
    """The pinned requirements the image does not meet (at their pins' lowest version) and, transitively,
    the requirements of what was fetched that the image may not meet (pip's newest) -> (wheels, the
    requirements left to the image)."""
    environment = device_environment(python_version)
    queue = [(r, lowest_allowed(r)) for r in roots]
    fetched: dict[str, Path] = {}
    left: list[str] = []
    while queue:
        requirement, spec = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in fetched:
            version = parse_wheel_filename(fetched[name].name)[1]
            if not requirement.specifier.contains(version, prereleases=True):
                raise SystemExit(f"{fetched[name].name} was fetched, but something requires {requirement}")
            continue
        if image_meets(requirement):
            left.append(str(requirement))
            continue
        wheel = pip_download(spec, into, python_version)
        fetched[name] = wheel
        print(f"fetched {wheel.name} ({wheel.stat().st_size / 2**20:.2f} MiB) for {requirement}", flush=True)
        queue += [(r, str(r)) for r in wheel_requirements(wheel) if needed(r, environment)]
    return list(fetched.values()), sorted(set(left))


def pack(wheels: list[Path], archive: Path):
    """The wheels' files in one xz tar, each under a folder named as its wheel: solid compression finds
    what the many similar files of transformers share, which each wheel's zip cannot."""
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for wheel in sorted(wheels):
            with zipfile.ZipFile(wheel) as zf:
                for entry in zf.infolist():
                    if entry.is_dir():
                        continue
                    info = tarfile.TarInfo(f"{wheel.name}/{entry.filename}")
                    info.size, info.mode = entry.file_size, (entry.external_attr >> 16) & 0o777 or 0o644
                    tar.addfile(info, io.BytesIO(zf.read(entry)))


def unpack(archive: Path, into: Path) -> list[Path]:
    """The wheels again from `pack`'s archive, as stored zips (RECORD's hashes are of the files, not the zip)."""
    zips: dict[str, zipfile.ZipFile] = {}
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            wheel, _, name = member.name.partition("/")
            if wheel not in zips:
                zips[wheel] = zipfile.ZipFile(into / wheel, "w", zipfile.ZIP_STORED)
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = member.mode << 16
            zips[wheel].writestr(entry, tar.extractfile(member).read())
    for zf in zips.values():
        zf.close()
    return sorted(into / wheel for wheel in zips)


def travelling_bytes(repo: Path) -> int:
    """What every device call sends besides the carried folders: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    paths = (repo / name for name in listed.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


def fetch(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (ARCHIVE, MANIFEST):
        (out / stale).unlink(missing_ok=True)
    roots = pinned_requirements(REPO / "pyproject.toml") + [Requirement(spec) for spec in args.also]
    with tempfile.TemporaryDirectory() as tmp:
        wheels, left = fetch_wheels(roots, Path(tmp), args.python_version)
        if not wheels:
            raise SystemExit("the image meets every requirement: nothing to fetch")
        wheel_bytes = {w.name: w.stat().st_size for w in wheels}
        print(f"packing {len(wheels)} wheels ({sum(wheel_bytes.values()) / 2**20:.2f} MiB) ...", flush=True)
        pack(wheels, out / ARCHIVE)
    archive_bytes = (out / ARCHIVE).stat().st_size
    checkout = travelling_bytes(REPO)
    limit = (DEVICE_TOOL_MIB - args.headroom_mib) * 2**20 - checkout
    if archive_bytes > limit:
        (out / ARCHIVE).unlink()
        raise SystemExit(
            f"the archive is {archive_bytes / 2**20:.2f} MiB, but the checkout travels with {checkout / 2**20:.2f} MiB "
            f"of the device tool's {DEVICE_TOOL_MIB} MiB, leaving {limit / 2**20:.2f} MiB with {args.headroom_mib} MiB "
            "kept free: no archive written"
        )
    manifest = {
        "python_version": args.python_version,
        "platforms": PLATFORMS,
        "wheels": wheel_bytes,
        "archive_bytes": archive_bytes,
        "left_to_the_image": left,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"left to the image: {', '.join(left)}")
    print(
        f"{out / ARCHIVE}: {archive_bytes / 2**20:.2f} MiB for {len(wheels)} wheels of "
        f"{sum(wheel_bytes.values()) / 2**20:.2f} MiB; the checkout travels with {checkout / 2**20:.2f} MiB "
        f"(limit {limit / 2**20:.2f} MiB)"
    )


def unmet_requirements(site: Path) -> list[str]:
    """Each requirement of a distribution installed in `site` that this interpreter (with `site` first
    on its path) does not meet: missing, or at a version outside its bounds."""
    environment = default_environment()
    unmet = []
    for dist in metadata.distributions(path=[str(site)]):
        for requirement in map(Requirement, dist.requires or []):
            if not needed(requirement, environment):
                continue
            try:
                version = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: {version} here")
    return unmet


def install(args) -> None:
    folder, site = Path(args.out), Path(args.install)
    manifest = json.loads((folder / MANIFEST).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        wheels = unpack(folder / ARCHIVE, Path(tmp))
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile"]
        command += ["--no-cache-dir", "--target", str(site)]
        if args.for_fetched_platform:
            platforms = [arg for tag in manifest["platforms"] for arg in ("--platform", tag)]
            command += ["--only-binary=:all:", "--implementation", "cp", *platforms]
            command += ["--python-version", manifest["python_version"]]
        print(" ".join(command[1:7]), "...", flush=True)
        # no pip warning for root (the device runs as root); an older pip ignores the variable
        subprocess.run(
            command + [str(w) for w in wheels], check=True, env=os.environ | {"PIP_ROOT_USER_ACTION": "ignore"}
        )
    installed = ", ".join(
        sorted(f"{name} {version}" for name, version, *_ in (parse_wheel_filename(w.name) for w in wheels))
    )
    if args.for_fetched_platform:
        print(f"installed for CPython {manifest['python_version']} (not checked here): {installed}")
        return
    sys.path.insert(0, str(site))
    unmet = unmet_requirements(site)
    for line in unmet:
        print(f"unmet: {line}")
    print(f"installed {installed}; unmet requirements: {len(unmet) or 'none'}")
    if unmet:  # installed all the same: exit 3, apart from a failed install's 1
        raise SystemExit(UNMET_EXIT)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / ".device_wheels"), help="the folder that travels (ignored)")
    parser.add_argument("--python-version", default="3.12", help="the device's CPython, MAJOR.MINOR (3.12.3 seen)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME==VERSION", help="one more to fetch")
    parser.add_argument(
        "--headroom-mib", type=float, default=2.0, help="of the 64 MiB, kept free for files added before a call"
    )
    parser.add_argument("--install", metavar="SITE", help="on the device: install the archive's wheels into SITE")
    parser.add_argument(
        "--for-fetched-platform",
        action="store_true",
        help="with --install: for the manifest's platform and Python, unchecked (the CPU dry run)",
    )
    args = parser.parse_args()
    if args.install:
        install(args)
    else:
        fetch(args)


if __name__ == "__main__":
    main()
