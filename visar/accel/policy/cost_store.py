"""Measurements kept on disk, so that a second process on the same machine measures nothing.

`auto` times its candidates once per model, device, dtype, batch size, guidance and sampling
settings; a process that starts again (a second `visar generate`, each torchrun worker) would time
them again, images decoded by slower candidates before it runs the fastest. What it measured is
kept in one JSON file in visar's cache folder (`core.cache.cache_root`: `$VISAR_CACHE`, else
`~/.cache/visar`, where the relaxed methods keep their codebook neighbours too). An entry is found
again only by the same key on the same machine: the model's fingerprint (its class, parameter
names, shapes, dtypes and first values), the torch version, the processor or GPU, and the CPU
thread count, beside the caller's own key (`auto.TUNING_FILE`). Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from ..core.cache import cache_root


def model_fingerprint(model) -> str:
    """Its class, and each parameter's and buffer's name, shape, dtype and first 64 values: the same
    weights give the same fingerprint in every process, without hashing gigabytes."""
    sha = hashlib.sha256(type(model).__qualname__.encode())
    state = model.state_dict() if isinstance(model, torch.nn.Module) else {}
    for name, tensor in state.items():
        sha.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        head = tensor.detach().flatten()[:64].float().cpu()  # read once, when the costs are looked up
        sha.update(head.numpy().tobytes())
    return sha.hexdigest()[:20]


def machine(device: torch.device) -> str:
    """What the timings belong to: the GPU's name, or the processor and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} {platform.processor() or cpu_name()} threads={torch.get_num_threads()}"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return ""


def entry_name(model, key: tuple) -> str:
    """The name what was measured for this model under `key` is kept by on this machine."""
    device = torch.device(str(model.device))
    return json.dumps([model_fingerprint(model), torch.__version__, machine(device), *map(str, key)])


def read_entries(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # no file yet, or one cut short: measure again
        return {}
    return entries if isinstance(entries, dict) else {}


def load_entry(file_name: str, name: str) -> dict | None:
    """The entry kept under `name` (`entry_name`) in `file_name` of the cache folder, or None."""
    entry = read_entries(cache_root() / file_name).get(name)
    return entry if isinstance(entry, dict) else None


def save_entry(file_name: str, name: str, entry: dict) -> None:
    """Keep `entry` under `name` (`entry_name`) in `file_name`; a folder that cannot be written keeps
    nothing (what it holds is then measured again next time, as before there was a store)."""
    folder = cache_root()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / file_name
        entries = read_entries(path)
        entries[name] = entry
        # written whole and renamed into place: a process reading it meanwhile sees the old or the new file
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
            json.dump(entries, tmp, indent=1)
        os.replace(tmp.name, path)
    except OSError:
        return
