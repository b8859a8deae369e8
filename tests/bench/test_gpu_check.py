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
    assert "unknown layout 'paged' in --layouts; choose from" in capsys.readouterr().err
    assert module.main(["--device", "cpu", "--mib", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_link_peak_follows_the_pcie_generation():
    module = _load()
    assert module._link_gib_s(32.0, 16) == pytest.approx(63.0e9 / (1 << 30), rel=1e-3)  # Gen5 x16
    assert module._link_gib_s(5.0, 16) == pytest.approx(5e9 * 16 * 0.8 / 8 / (1 << 30))  # Gen2: 8b/10b


@pytest.mark.parametrize(("args", "sentence"), [
    (["--pages-kib", "1e9"], "--pages-kib has '1e9': each page size must be above 0 and at most 1048576 KiB"),
    (["--pages-kib", "16,nan"], "--pages-kib has 'nan': each page size must be above 0"),
    (["--pages-kib", "16,x"], "--pages-kib has 'x', not a number of KiB"),
    (["--pages-kib", "300000"], "--pages-kib has '300000': one page per layer (32 layers) is more than the --mib 256"),
    (["--layers", "0"], "--layers must be positive, got 0."),
    (["--repeats", "-1"], "--repeats must be positive, got -1."),
    (["--mib", "1000000"], "--mib must be at most 65536"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
])
def test_gpu_check_names_the_one_bad_flag(capsys, args, sentence):
    """Fixes item 3: each bad argument is one sentence naming its own flag, exit 2, before any work."""
    assert _load().main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert sentence in err and err.count("\n") == 1, err
    other_flags = {"--layers", "--kv-heads", "--head-size", "--chunk-tokens", "--mib", "--repeats", "--pages-kib"}
    named = {flag for flag in other_flags if flag in err}
    assert named <= {args[0], "--mib"}, err  # the page bound names --mib as the way out


def test_gpu_check_refuses_an_unwritable_json_path_up_front(tmp_path, capsys):
    """Fixes item 3: --json under a regular file cannot be written: said before the run, exit 2 (not 1,
    which means a failed round trip), no traceback, and nothing left behind."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _load().main(["--device", "cpu", "--json", str(blocker / "out.json")]) == 2
    captured = capsys.readouterr()
    assert "--json" in captured.err and "cannot be written" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""  # refused before any check ran
    writable = tmp_path / "ok.json"
    assert _load()._writable(writable) is None and not writable.exists()


def test_gpu_check_says_it_rounds_pages_and_labels_host_figures(tmp_path, capsys):
    """Fixes item 3: --pages-kib 3 is 4 KiB pages (whole 4 KiB tokens): said, not silent; a host
    run's GiB/s are labelled host memcpy figures (docs/benchmarks.md)."""
    out = tmp_path / "check.json"
    assert _load().main(["--device", "cpu", "--layers", "2", "--pages-kib", "3", "--chunk-tokens", "16", "--mib", "1",
                         "--repeats", "1", "--layouts", "kv-split", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "page sizes rounded to whole tokens per block: kv-split 3 -> 4.0 KiB" in text
    assert "every GiB/s below is a host memcpy figure" in text
    report = json.loads(out.read_text())
    assert report["gib_s_are"] == "host memcpy" and report["results"][0]["page_bytes"] == 4096


def test_gpu_check_help_explains_every_shape_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per flag
    assert _load().main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag, words in (("--layers", "attention layers"), ("--kv-heads", "KV heads"), ("--head-size", "head size"),
                        ("--layouts", "kv-split")):
        assert flag in text and words in text, flag


def test_runner_mode_drives_the_worker_side_byte_exact_in_every_layout_and_page_size(tmp_path, capsys):
    """Issue 37 item 4, on the host: kvtier's worker side driven as vLLM's GPU model runner drives a
    connector (deferred saves held until finished_sending, synchronous loads whole and layer by
    layer, disk loads through the device endpoint) round-trips every layout at every page size of
    the sweep's ends byte for byte."""
    out = tmp_path / "runner.json"
    rc = _load().main(["--device", "cpu", "--mode", "runner", "--layers", "3", "--pages-kib", "16,64,2048",
                       "--chunk-tokens", "16", "--mib", "8", "--runner-mib", "2", "--repeats", "1",
                       "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["results"] == []  # runner mode only
    rows = report["runner"]
    assert [r["layout"] for r in rows] == ["kv-split", "blocks-first", "mla"] * 3
    for r in rows:
        assert r["equal"] is True, r
        # a save the saver thread copied: its request held for at least the step that names it
        assert r["held_steps"] >= 1 and r["blocked_us"] > 0 and r["save_gib_s"] > 0 and r["load_gib_s"] > 0
        assert r["ttft_whole_ms"] > 0 and r["ttft_layerwise_ms"] > 0
        # device endpoint (issue 37 item 2): disk chunks without a cpu page, loaded from their landing
        # buffers (equal also holds every load read from disk and none promoted); no bounce on the host
        assert r["endpoint_gib_s"] > 0 and r["endpoint_load_gib_s"] > 0
        assert r["endpoint_bounced_runs"] == 0 and r["endpoint_pinned"] is False
        assert r["bytes_per_direction"] % (3 * r["page_bytes"]) == 0  # whole blocks of every layer
    assert {round(r["page_bytes"] / 1024) for r in rows} >= {16, 64, 2048}
    text = capsys.readouterr().out
    assert "estimated run time at most about" in text and "bytes equal after the round trip: True" in text


def test_runner_mode_needs_no_vllm(tmp_path):
    """The GPU machine has no vLLM: the runner mode imports and runs with every vLLM import failing."""
    import subprocess

    code = (f"import sys; sys.modules['vllm'] = None; sys.argv[0] = {str(SCRIPT)!r}; "
            f"import runpy; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--mode", "runner", "--layers", "2",
                           "--pages-kib", "16", "--chunk-tokens", "16", "--runner-mib", "1", "--repeats", "1",
                           "--layouts", "kv-split"], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bytes equal after the round trip: True" in done.stdout
