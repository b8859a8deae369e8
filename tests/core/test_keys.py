"""Chunk keys: chained, deterministic across processes, isolated by namespace and request inputs."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvtier.core.keys import KEY_BYTES, Namespace, chunk_keys, request_root

NS = Namespace(model="m", kv_dtype="bfloat16", num_layers=32, num_kv_heads=8, head_size=128, layout="L")
TOKENS = list(range(1000))

SCRIPT = """
from kvtier.core.keys import Namespace, chunk_keys, request_root
ns = Namespace(model="m", kv_dtype="bfloat16", num_layers=32, num_kv_heads=8, head_size=128, layout="L")
print(",".join(k.hex() for k in chunk_keys(request_root(ns, cache_salt="s"), list(range(1000)), 256)))
"""


def test_keys_identical_across_processes_with_different_hash_seeds():
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    here = ",".join(k.hex() for k in chunk_keys(request_root(NS, cache_salt="s"), TOKENS, 256))
    assert outputs == {here}


def test_only_full_chunks_get_keys_and_keys_are_128_bit():
    keys = chunk_keys(request_root(NS), TOKENS, 256)
    assert len(keys) == 3  # 1000 // 256; the 232-token tail is always recomputed
    assert all(len(k) == KEY_BYTES == 16 for k in keys)
    assert len(set(keys)) == 3


def test_chain_shares_prefix_and_diverges_after_first_difference():
    root = request_root(NS)
    a = chunk_keys(root, TOKENS, 100)
    changed = TOKENS.copy()
    changed[450] = 99999
    b = chunk_keys(root, changed, 100)
    assert a[:4] == b[:4]
    assert all(x != y for x, y in zip(a[4:], b[4:]))  # chained: everything after the change differs


@pytest.mark.parametrize("field,value", [
    ("model", "other"), ("kv_dtype", "fp8_e4m3"), ("num_layers", 16), ("num_kv_heads", 4),
    ("head_size", 64), ("layout", "other"), ("tp_size", 2), ("tp_rank", 1), ("chunk_tokens", 512),
])
def test_every_namespace_field_changes_every_key(field, value):
    base = chunk_keys(request_root(NS), TOKENS, 256)
    other = chunk_keys(request_root(replace(NS, **{field: value})), TOKENS, 256)
    assert not set(base) & set(other)


def test_cache_salt_lora_and_multimodal_isolate():
    roots = {
        "none": request_root(NS),
        "salt-a": request_root(NS, cache_salt="a"),
        "salt-b": request_root(NS, cache_salt="b"),
        "lora": request_root(NS, lora="adapter-1"),
        "mm": request_root(NS, mm_hashes=["img1"]),
        "mm2": request_root(NS, mm_hashes=["img2"]),
    }
    assert len(set(roots.values())) == len(roots)
    assert request_root(NS, cache_salt="a") == roots["salt-a"]  # same salt shares


def test_bad_chunk_size_rejected():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_keys(request_root(NS), TOKENS, 0)
