"""scripts/gpu_check.py on the host (``--device cpu``): the smoke test of the CUDA check script.

The script is meant for a CUDA machine (see its docstring); here it proves that every layout it
builds round-trips through kvtier's copy path and cpu tier byte for byte at every page size it
sweeps, on the host's per-block path and on the batched path CUDA takes, and that it reports.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", ["auto", "batched"])
def test_gpu_check_round_trips_every_layout_on_cpu(tmp_path, capsys, path):
    out = tmp_path / "check.json"
    rc = _load().main(["--device", "cpu", "--layers", "3", "--pages-kib", "16,256", "--chunk-tokens", "16",
                       "--mib", "1", "--repeats", "1", "--path", path, "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert [(r["layout"], r["block_tokens"]) for r in results] == [
        ("kv-split", 4), ("blocks-first", 4), ("mla", 14), ("kv-split", 64), ("blocks-first", 64), ("mla", 228)]
    # 1 MiB in whole chunks: 5 chunks of 4 blocks (16 KiB pages), 21 of 1 (MLA's 14-token pages); 2x + 1 blocks
    assert [r["shape"] for r in results[:3]] == [[2, 41, 4, 8, 128], [41, 2, 4, 8, 128], [43, 14, 576]]
    for r in results:
        assert r["equal"] is True and r["pinned"] is False and r["staged_runs"] == 0
        assert r["bytes_per_direction"] == r["blocks"] * 3 * r["page_bytes"]
        assert r["save_gib_s"] > 0 and r["plain_d2h_gib_s"] > 0
    assert report["pcie_peak_source"] == "none (host run)"
    assert "bytes equal after the round trip: True" in capsys.readouterr().out


def test_gpu_check_refuses_a_missing_cuda_device(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert _load().main(["--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_gpu_check_refuses_bad_arguments_in_one_sentence(capsys):
    module = _load()
    assert module.main(["--device", "cpu", "--layouts", "kv-split,paged"]) == 2
    assert "unknown layout 'paged'; choose from" in capsys.readouterr().err
    assert module.main(["--device", "cpu", "--mib", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_link_peak_follows_the_pcie_generation():
    module = _load()
    assert module._link_gib_s(32.0, 16) == pytest.approx(63.0e9 / (1 << 30), rel=1e-3)  # Gen5 x16
    assert module._link_gib_s(5.0, 16) == pytest.approx(5e9 * 16 * 0.8 / 8 / (1 << 30))  # Gen2: 8b/10b
