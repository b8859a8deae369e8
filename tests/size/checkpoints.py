"""Model directories as a download leaves them, for ``kvtier size``'s weights reading."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_safetensors(path: Path, payload_bytes: int) -> int:
    """Write a safetensors file of one uint8 tensor of ``payload_bytes`` (the format: an 8-byte
    little-endian header length, the JSON header, the data); return the file's size."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [payload_bytes], "data_offsets": [0, payload_bytes]}}).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes with spaces
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * payload_bytes)
    return path.stat().st_size


def write_lfs_pointer(path: Path, size: int) -> None:
    """What a clone without ``git lfs pull`` leaves in place of a file (git-lfs docs/spec.md)."""
    path.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'4d' * 32}\nsize {size}\n")
