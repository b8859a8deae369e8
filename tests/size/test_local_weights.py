"""The weights of a local checkpoint (nu5): Git LFS pointers, partial and missing shards were summed
as the weights (~0 GiB, so an HBM KV budget far too big); ``model.safetensors.index.json``'s
``metadata.total_size`` was ignored; the table's "weights" row gave no GiB."""

from __future__ import annotations

import json
from pathlib import Path

from tests.size.checkpoints import write_lfs_pointer, write_safetensors
from tests.size.test_size_hardening import _json, run

GIB = 1 << 30
CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"}


def _model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _index(directory: Path, shards: list[str], total_size: int | None) -> None:
    meta = {"total_size": total_size} if total_size is not None else {}
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": meta, "weight_map": {f"layer{i}.weight": name for i, name in enumerate(shards)}}))


def test_git_lfs_pointers_are_refused_in_one_sentence_naming_weights_gib(tmp_path):
    model = _model(tmp_path)
    for i in (1, 2, 3):
        write_lfs_pointer(model / f"model-0000{i}-of-00003.safetensors", 4_966_157_056)
    result = run("--model", str(model), "--gpu", "H100")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Git LFS pointers" in result.output and "--weights-gib" in result.output
    assert _json("--model", str(model), "--gpu", "H100", "--weights-gib", "14")["weights_gib"] == 14


def test_a_file_too_small_or_without_a_json_header_is_not_a_shard(tmp_path):
    model = _model(tmp_path)
    for payload in (b"garbage", b"\x10\0\0\0\0\0\0\0not json at all!", b"\xff" * 64):
        (model / "model.safetensors").write_bytes(payload)
        result = run("--model", str(model), "--gpu", "H100")
        assert result.exit_code == 2 and "--weights-gib" in result.output and "model.safetensors" in result.output


def test_a_shard_cut_short_is_not_the_weights(tmp_path):
    """An interrupted download keeps a whole header and part of the data."""
    model = _model(tmp_path)
    size = write_safetensors(model / "model.safetensors", 1 << 20)
    with (model / "model.safetensors").open("r+b") as f:
        f.truncate(size - 1000)
    result = run("--model", str(model), "--gpu", "H100")
    assert result.exit_code == 2 and "cut short" in result.output and "--weights-gib" in result.output


def test_shards_missing_from_the_index_or_their_numbering_are_refused(tmp_path):
    model = _model(tmp_path)
    write_safetensors(model / "model-00001-of-00002.safetensors", 1024)
    result = run("--model", str(model), "--gpu", "H100")  # no index: the name says 2 shards
    assert result.exit_code == 2 and "model-00002-of-00002.safetensors" in result.output
    write_safetensors(model / "model-00002-of-00002.safetensors", 1024)
    _index(model, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "extra.safetensors"], None)
    result = run("--model", str(model), "--gpu", "H100")
    assert result.exit_code == 2 and "extra.safetensors" in result.output


def test_the_index_total_size_is_the_weights_and_the_row_prints_gib(tmp_path):
    """total_size is authoritative (the shards may still be pointers: sizing needs only the size)."""
    model = _model(tmp_path)
    write_lfs_pointer(model / "model-00001-of-00002.safetensors", 8 * GIB)
    write_lfs_pointer(model / "model-00002-of-00002.safetensors", 8 * GIB)
    _index(model, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], 16 * GIB)
    data = _json("--model", str(model), "--gpu-memory-gib", "80")
    assert data["weights_gib"] == 16 and "total_size" in data["weights_note"]
    assert data["hbm_kv_budget_bytes"] == int((80 * 0.9 - 16 - 4) * GIB)
    table = run("--model", str(model), "--gpu-memory-gib", "80")
    assert "16.00 GiB (metadata.total_size" in table.output


def test_valid_shards_are_summed(tmp_path):
    model = _model(tmp_path)
    sizes = [write_safetensors(model / f"model-0000{i}-of-00002.safetensors", 4096 * i) for i in (1, 2)]
    data = _json("--model", str(model), "--gpu-memory-gib", "80")
    assert data["weights_gib"] == sum(sizes) / GIB and data["weights_note"] == "sum of 2 *.safetensors next to config.json"


def test_without_a_gpu_the_bad_weights_are_a_note_not_a_refusal(tmp_path):
    """KV bytes per token need no weights: ``kvtier size --model DIR`` still answers, and says why the
    weights are unknown."""
    model = _model(tmp_path)
    write_lfs_pointer(model / "model.safetensors", GIB)
    data = _json("--model", str(model))
    assert data["kv_bytes_per_token"] == 2 * 2 * 4 * 64 * 2 and data["weights_gib"] is None
    assert any("Git LFS pointers" in note for note in data["notes"])
