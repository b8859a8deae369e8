"""scripts/gpu_check.py on the host (``--device cpu``): the smoke test of the CUDA check script.

The script is meant for a CUDA machine (see its docstring); here it proves that every layout it
builds round-trips through kvtier's copy path and cpu tier byte for byte, and that it reports.
"""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_round_trips_every_layout_on_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = _load().main(["--device", "cpu", "--layers", "3", "--num-blocks", "48", "--blocks-per-chunk", "4",
                       "--chunks", "2", "--repeats", "1", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [r["layout"] for r in results] == ["kv-split", "blocks-first", "mla"]
    assert [r["shape"] for r in results] == [[2, 48, 16, 8, 128], [48, 2, 16, 8, 128], [48, 16, 576]]
    for r in results:
        assert r["equal"] is True and r["blocks"] == 8
        assert r["save_gib_s"] > 0 and r["plain_d2h_gib_s"] > 0
    assert "bytes equal" in capsys.readouterr().out


def test_gpu_check_refuses_a_missing_cuda_device(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert _load().main(["--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err
