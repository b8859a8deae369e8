"""Find a model's geometry: a local ``config.json``, a built-in preset, or the Hugging Face hub.

Order: an existing path wins; then a preset (``kvtier size --list-presets``); then, for an
``org/name`` id, the hub's ``config.json`` over HTTPS (``HF_ENDPOINT`` honoured), which only works
where the hub is reachable.  Weights size: the sum of ``*.safetensors`` files next to a local
config, the preset's checkpoint size, or unknown (None).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import ServerAnswerError, UserError
from kvtier.size.geometry import KVGeometry
from kvtier.size.hf_config import dtype_note, geometry_from_config, load_config_file
from kvtier.size.presets import GIB, find_preset
from kvtier.tools.httpget import get_within


@dataclass(frozen=True)
class ResolvedModel:
    """A model's geometry and, when known, its weights size (GiB) and how that was found.

    ``warnings`` lists what was skipped while reading local files (e.g. a dangling ``*.safetensors`` link);
    ``dtype_note`` says the config's dtype is read as bf16, as vLLM does (:func:`~kvtier.size.hf_config.dtype_note`).
    """

    geometry: KVGeometry
    weights_gib: float | None
    weights_note: str
    warnings: tuple[str, ...] = ()
    dtype_note: str | None = None


def _local_weights(directory: Path) -> tuple[float | None, str, tuple[str, ...]]:
    """Sum (GiB) of the non-empty regular ``*.safetensors`` files in ``directory`` (None when none
    counts), how it was found, and a warning naming the ones skipped (dangling links, directories,
    empty files)."""
    sizes: list[int] = []
    skipped: list[str] = []
    for f in sorted(directory.glob("*.safetensors")):
        try:
            size = f.stat().st_size if f.is_file() else None
        except OSError:
            size = None
        if size is None:
            skipped.append(f"{f.name} (not a readable file)")
        elif size == 0:
            skipped.append(f"{f.name} (empty)")
        else:
            sizes.append(size)
    note = f"sum of {len(sizes)} *.safetensors next to config.json" if sizes else ""
    warnings = (f"Weights size ignores {', '.join(skipped)}; pass --weights-gib if that is wrong.",) if skipped else ()
    return (sum(sizes) / GIB if sizes else None), note, warnings


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
        weights, note, warnings = _local_weights(directory)
        return ResolvedModel(geometry_from_config(cfg, str(path), source=str(config_file)), weights, note, warnings,
                             dtype_note(cfg))
    preset = find_preset(name)
    if preset is not None:  # named as asked: an alias (the base model of an -Instruct preset) shares its geometry
        return ResolvedModel(preset.geometry(name.strip()), preset.weights_gib, preset.weights_note)
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".json"):
        raise UserError(f"{name} does not exist; pass a model directory or its config.json, a built-in preset "
                        "(see --list-presets) or a hub id like org/name.")
    if name.count("/") == 1 and not name.startswith((".", "/")) and hub:
        cfg = _fetch_hub_config(name, hub_timeout_s)
        return ResolvedModel(geometry_from_config(cfg, name, source=f"hub: {name}/config.json"), None, "", (),
                             dtype_note(cfg))
    raise UserError(
        f"{name!r} is not an existing path, a built-in preset (see --list-presets) or a hub id like org/name."
    )
