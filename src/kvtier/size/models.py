"""Find a model's geometry: a local ``config.json``, a built-in preset, or the Hugging Face hub.

Order: an existing path wins; then a preset (``kvtier size --list-presets``); then, for an
``org/name`` id, the hub's ``config.json`` over HTTPS (``HF_ENDPOINT`` honoured), which only works
where the hub is reachable.  Weights size: a local checkpoint's ``model.safetensors.index.json``
``metadata.total_size``, else the sum of the ``*.safetensors`` files next to its config (refused when
they are Git LFS pointers, partial or missing shards), the preset's checkpoint size, or unknown (None).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import ServerAnswerError, UserError
from kvtier.size.context import max_context
from kvtier.size.geometry import KVGeometry
from kvtier.size.hf_config import auto_dtype, dtype_note, geometry_from_config, load_config_file
from kvtier.size.presets import GIB, find_preset
from kvtier.tools.httpget import get_within


@dataclass(frozen=True)
class ResolvedModel:
    """A model's geometry and, when known, its weights size (GiB) and how that was found.

    ``weights_problem`` says why the
    ``*.safetensors`` next to a local config cannot be the weights (Git LFS pointers, shards missing or
    not safetensors files: :func:`_local_weights`), with ``weights_gib`` None then; ``dtype_note`` says
    the config's dtype is read as bf16, as vLLM does (:func:`~kvtier.size.hf_config.dtype_note`);
    ``auto_dtype`` is what vLLM's ``--dtype auto`` runs it in (:func:`~kvtier.size.hf_config.auto_dtype`).
    """

    geometry: KVGeometry
    weights_gib: float | None
    weights_note: str
    dtype_note: str | None = None
    auto_dtype: str = "bf16"
    weights_problem: str | None = None
    max_context: tuple[int, str] | None = None
    """The context window from config.json, as vLLM derives it (:func:`~kvtier.size.context.max_context`);
    None for a preset or a config without a length key."""


LFS_POINTER = b"version https://git-lfs.github.com/spec/"
"""How a Git LFS pointer file starts (git-lfs docs/spec.md): a clone without ``git lfs pull`` has these
~130-byte files where the weights should be."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header (the format's own bound, safetensors ``N_MAX_HEADER``)."""


def _shard_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None: a safetensors file starts with its header's
    length (8 bytes, little-endian), then that many bytes of a JSON object whose tensors'
    ``data_offsets`` end within the file (the safetensors format); a download cut short ends before."""
    try:
        if not path.is_file():
            return "not a readable file"
        with path.open("rb") as f:
            head = f.read(len(LFS_POINTER))
            if head.startswith(LFS_POINTER):
                return "Git LFS pointers: git lfs pull fetches the files"
            size = path.stat().st_size
            length = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
            if size < 8 or not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
                return f"{size:,} bytes without a safetensors header"
            f.seek(8)
            header = json.loads(f.read(length))
    except OSError:
        return "not a readable file"
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "a safetensors header that is not JSON"
    if not isinstance(header, dict):
        return "a safetensors header that is not a JSON object"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
            and isinstance(t["data_offsets"][1], int)]
    if 8 + length + max(ends, default=0) > size:  # safetensors refuses it too (MetadataIncompleteBuffer)
        return f"cut short: {size:,} of the {8 + length + max(ends):,} bytes its header describes"
    return None


def _index(directory: Path) -> tuple[int | None, set[str]]:
    """``metadata.total_size`` (bytes; None when absent) and the shard names of ``weight_map`` in
    ``model.safetensors.index.json`` (Hugging Face's sharded checkpoints); ``(None, set())`` without one."""
    try:
        data = json.loads((directory / "model.safetensors.index.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None, set()
    if not isinstance(data, dict):
        return None, set()
    meta, weight_map = data.get("metadata"), data.get("weight_map")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    return total, {str(v) for v in weight_map.values()} if isinstance(weight_map, dict) else set()


def _numbered_shards(files: list[Path]) -> set[str]:
    """Every shard the names of ``files`` imply: ``model-00001-of-00030.safetensors`` implies 30."""
    implied: set[str] = set()
    for f in files:
        if (m := re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", f.name)) and int(m[3]) <= 100_000:
            implied.update(f"{m[1]}-{i:0{len(m[2])}d}-of-{m[3]}.safetensors" for i in range(1, int(m[3]) + 1))
    return implied


def _names(names: list[str]) -> str:
    """Up to three of ``names``, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _local_weights(directory: Path) -> tuple[float | None, str, str | None]:
    """Weights (GiB) of the checkpoint in ``directory``, how they were found, and why the files there
    cannot be the weights (None when they can, or when there are none).

    ``metadata.total_size`` of ``model.safetensors.index.json`` is the weights' size when present;
    else the sum of the ``*.safetensors`` files, each checked to be one (not a Git LFS pointer, a
    dangling link, an empty or partial file) and, with an index, every shard it names present.
    """
    total, shards = _index(directory)
    if total is not None:
        return total / GIB, "metadata.total_size of model.safetensors.index.json", None
    files = sorted(directory.glob("*.safetensors"))
    why_to_names: dict[str, list[str]] = {}
    for f in files:
        if (why := _shard_problem(f)) is not None:
            why_to_names.setdefault(why, []).append(f.name)
    missing = sorted((shards | _numbered_shards(files)) - {f.name for f in files})
    if missing:
        why_to_names["absent: the index or the shards' names (-of-N) list them"] = missing
    if why_to_names:
        bad = "; ".join(f"{_names(names)} ({why})" for why, names in why_to_names.items())
        return None, "", (f"the *.safetensors next to {directory / 'config.json'} are not the weights: {bad}; pass "
                          "--weights-gib with the model's weights in GiB.")
    if not files:
        return None, "", None
    return sum(f.stat().st_size for f in files) / GIB, f"sum of {len(files)} *.safetensors next to config.json", None


def _fetch_hub_config(repo_id: str, timeout_s: float) -> dict[str, object]:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/{repo_id}/resolve/main/config.json"
    try:  # timeout_s in all (kvtier.tools.httpget): a hub or proxy that trickles cannot hold `kvtier size`
        response = get_within(url, timeout_s, "its config.json", max_body_bytes=4 << 20, follow_redirects=True)
    except ServerAnswerError as exc:
        raise UserError(
            f"{repo_id!r} is neither a local path nor a built-in preset, and the hub is unreachable or too slow ({exc}); "
            "pass the path of its config.json."
        ) from None
    if response.status != 200:
        raise UserError(
            f"the hub answered {response.status} for {repo_id}'s config.json (gated or misspelt?); "
            "download config.json and pass its path."
        )
    try:
        data = json.loads(response.text)
    except (json.JSONDecodeError, RecursionError):
        raise UserError(f"the hub's config.json for {repo_id} is not JSON (or nested too deeply); pass a local "
                        "config.json.") from None
    if not isinstance(data, dict):
        raise UserError(f"the hub's config.json for {repo_id} is not a JSON object.")
    return data


def resolve_model(name: str, hub_timeout_s: float = 10.0, hub: bool = True) -> ResolvedModel:
    """Resolve ``name`` (a path, a preset repo id, or a hub repo id) to its geometry, named ``name``
    as given.  The one resolver of ``kvtier size``, ``kvtier simulate --model`` and ``kvtier audit``
    (``hub=False``: never the network; a hub id that is no preset is then refused).

    Raises:
        UserError: nothing matches, the hub cannot be reached, or config.json is incomplete.
    """
    path = Path(name).expanduser()
    if path.exists():
        cfg = load_config_file(path)
        directory = path if path.is_dir() else path.parent
        config_file = path / "config.json" if path.is_dir() else path
        weights, note, problem = _local_weights(directory)
        return ResolvedModel(geometry_from_config(cfg, str(path), source=str(config_file)), weights, note,
                             dtype_note(cfg), auto_dtype(cfg), problem, max_context(cfg))
    preset = find_preset(name)
    if preset is not None:  # named as asked: an alias (the base model of an -Instruct preset) shares its geometry
        return ResolvedModel(preset.geometry(name.strip()), preset.weights_gib, preset.weights_note)
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".json"):
        raise UserError(f"{name} does not exist; pass a model directory or its config.json, a built-in preset "
                        "(see --list-presets) or a hub id like org/name.")
    if name.count("/") == 1 and not name.startswith((".", "/")) and hub:
        cfg = _fetch_hub_config(name, hub_timeout_s)
        return ResolvedModel(geometry_from_config(cfg, name, source=f"hub: {name}/config.json"), None, "",
                             dtype_note(cfg), auto_dtype(cfg), max_context=max_context(cfg))
    raise UserError(
        f"{name!r} is not an existing path, a built-in preset (see --list-presets) or a hub id like org/name."
    )
