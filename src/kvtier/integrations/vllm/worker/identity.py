"""Identity fence: a fingerprint of what produced the KV bytes, beyond the model's name.

A persistent tier outlives the engine, so ``model@revision`` is not enough: a local model
directory has no revision, and its files can be replaced in place (a fine-tune copied over the
old weights, a re-quantization).  KV computed by the old weights must then never be served.

:func:`model_fingerprint` digests (BLAKE3, 16 bytes hex):

- every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): name, size, the
  safetensors header (tensor names, dtypes, shapes, offsets) and three 1 MiB samples of the
  content (start, middle, end of the file).  Sampling keeps start-up cheap on a 100 GiB model
  while any retrained or re-seeded weights differ in every sample; a change confined to bytes
  no sample covers is not seen (hash whole files for that, at start-up cost);
- the model's ``config.json`` and every tokenizer file (``tokenizer*``, ``vocab*``, ``merges*``,
  ``special_tokens_map.json``, ``added_tokens.json``, ``chat_template*``, ``*.tiktoken``) in full;
- :data:`CHUNK_FORMAT_VERSION`, kvtier's own chunk layout version (bump it when the bytes of a
  chunk page change meaning).

A model given as a Hugging Face repo id is resolved to its local snapshot (already downloaded
by vLLM) without network access; if it cannot be resolved, the fingerprint covers what is known
(name and revision) and says so in the log.

The files are not the whole story: ``--hf-overrides`` (``{"rms_norm_eps": 0.9}``, a rope
change), ``--quantization`` applied at load time and ``--dtype`` change the KV of the same files.
:func:`effective_config_digest` covers the configuration vLLM actually runs, after every override;
both go into the namespace (:func:`kvtier.integrations.vllm.worker.registration.build_namespace`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import blake3

from kvtier.core.tiers.disk.chunkfile import VERSION as CHUNK_FILE_VERSION

log = logging.getLogger(__name__)

CHUNK_FORMAT_VERSION = f"page-v2/file-v{CHUNK_FILE_VERSION}"
"""kvtier's chunk format: page layout ``[layers][blocks][block bytes]`` (v2) and the chunk file version."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")
_SAMPLE_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20


def resolve_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The local directory holding ``model`` (a path, or a cached Hugging Face snapshot); ``None`` if unknown."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id, or no huggingface_hub: unknown
        return None


def _weight_digest(path: Path, h: blake3.blake3) -> None:
    size = path.stat().st_size
    h.update(f"w\0{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            if 0 < n <= min(_MAX_HEADER_BYTES, size - 8):
                h.update(f.read(n))
        for offset in sorted({0, max(size // 2 - _SAMPLE_BYTES // 2, 0), max(size - _SAMPLE_BYTES, 0)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))


def _files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_file())
    except OSError:
        return []


def model_fingerprint(model: str, revision: str | None = None, tokenizer: str | None = None) -> str:
    """Hex fingerprint (32 chars) of the model's weights, config, tokenizer and the chunk format.

    Args:
        model: model path or Hugging Face repo id (vLLM's ``model_config.model``).
        revision: revision of a repo id, if any.
        tokenizer: tokenizer path or repo id when it differs from ``model``.

    Unreadable files are skipped (logged); the fingerprint never raises for missing files.
    """
    h = blake3.blake3(f"kvtier-identity\0{CHUNK_FORMAT_VERSION}\0".encode())
    for what, name in (("model", model), ("tokenizer", tokenizer or model)):
        directory = resolve_model_dir(name, revision)
        if directory is None:
            log.info("kvtier: %s %r is not a local directory or cached snapshot; its files are not fingerprinted",
                     what, name)
            h.update(f"unresolved\0{what}\0{name}\0{revision or ''}\0".encode())
            continue
        for path in _files(directory):
            try:
                if what == "model" and path.suffix in _WEIGHT_SUFFIXES:
                    _weight_digest(path, h)
                elif path.name == "config.json" or path.name.startswith(_TOKENIZER_PREFIXES) \
                        or path.suffix == ".tiktoken":
                    h.update(f"f\0{what}\0{path.name}\0".encode())
                    h.update(path.read_bytes())
            except OSError as exc:
                log.warning("kvtier: cannot read %s for the identity fingerprint (%s)", path, exc.strerror)
    return h.hexdigest(16)


def lora_identity(name: str, path: str) -> str:
    """A LoRA adapter's identity in the chunk keys' root: ``name@path``, then ``#`` and a fingerprint
    (32 hex chars) of the adapter's files when ``path`` is a local directory, so that an adapter
    replaced at the same path (retrained, or reloaded with ``load_inplace``) never meets KV its old
    weights computed, in a persistent tier (disk, redis, s3) after a restart or in another engine,
    as :func:`model_fingerprint` fences the model.  Its weight files are digested as the model's
    (name, size, safetensors header, three 1 MiB samples), every other file (``adapter_config.json``,
    tokenizer files) in full.  Each call lists and stats the directory; the digest is computed once
    per content signature (names, sizes, modification times) and kept.  Never raises: an unreadable
    directory gives ``name@path`` alone."""
    directory = Path(os.path.expanduser(path)) if path else None
    try:
        if directory is None or not directory.is_dir():
            return f"{name}@{path}"
        signature = tuple((p.name, st.st_size, st.st_mtime_ns) for p in _files(directory) for st in (p.stat(),))
    except OSError:
        return f"{name}@{path}"
    return f"{name}@{path}#{_adapter_digest(str(directory), signature)}"


@lru_cache(maxsize=256)
def _adapter_digest(directory: str, signature: tuple[tuple[str, int, int], ...]) -> str:
    h = blake3.blake3(b"kvtier-lora-adapter\0")
    for name, _size, _mtime_ns in signature:
        path = Path(directory) / name
        try:
            if path.suffix in _WEIGHT_SUFFIXES:
                _weight_digest(path, h)
            else:
                h.update(f"f\0{name}\0".encode())
                h.update(path.read_bytes())
        except OSError as exc:
            log.warning("kvtier: cannot read %s for the LoRA adapter fingerprint (%s)", path, exc.strerror)
    return h.hexdigest(16)


def effective_config_digest(model_config: Any) -> str:
    """Hex digest (16 chars) of the model configuration vLLM runs, after every override.

    Covers ``hf_config`` and ``hf_text_config`` as vLLM holds them (``--hf-overrides`` applied;
    serialized with transformers' ``to_json_string(use_diff=False)``, sorted keys), the load-time
    ``quantization`` and the model ``dtype``.  Two engines share KV only when all of it matches.

    Args:
        model_config: vLLM's ``vllm_config.model_config``.
    """
    h = blake3.blake3(b"kvtier-effective-config\0")
    for name in ("hf_config", "hf_text_config"):
        config = getattr(model_config, name, None)
        try:
            text = config.to_json_string(use_diff=False) if config is not None else "none"
        except (TypeError, ValueError, AttributeError):  # a field JSON cannot encode: its repr, minus any address
            text = json.dumps(vars(config), sort_keys=True, default=lambda o: re.sub(r" at 0x[0-9a-fA-F]+", "", repr(o)))
        h.update(f"{name}\0{text}\0".encode())
    for name in ("quantization", "dtype"):
        h.update(f"{name}\0{getattr(model_config, name, None)}\0".encode())
    return h.hexdigest(8)
