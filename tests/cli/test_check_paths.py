"""``kvtier check`` (the preflight the vLLM plugin runs before the model loads) refuses a path-valued
key the engine would refuse after the model loaded (fresh-user tester: ``receipt_log_path: /tmp``, a
directory, passed check and the api_server died 65 s in): one sentence each, exit 1."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.receiptlog import ReceiptLog


def _check(extra: dict[str, object]):
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)])


def test_a_receipt_log_path_that_is_a_directory_is_refused_by_check_as_the_engine_refuses_it(tmp_path):
    assert KVTierConfig.from_dict({"receipt_log_path": str(tmp_path)}).receipt_log_path == str(tmp_path)
    with pytest.raises(ConfigError, match="Is a directory"):  # what the engine does after the model loaded
        ReceiptLog(str(tmp_path), 1.0, 1 << 20, 2, 16).close()
    result = _check({"cpu_gib": 1, "receipt_log_path": str(tmp_path)})
    assert result.exit_code == 1, result.output
    assert (f"error: kv_connector_extra_config.receipt_log_path: receipt_log_path {str(tmp_path)!r} is a directory, "
            f"not a file; name a file in it, e.g. {str(tmp_path / 'receipts.jsonl')!r}") in result.output
    assert "Traceback" not in result.output and "ok: vLLM would start" not in result.output


def test_a_receipt_log_path_in_a_missing_directory_is_refused_and_a_good_one_passes(tmp_path):
    result = _check({"cpu_gib": 1, "receipt_log_path": str(tmp_path / "no" / "r.jsonl")})
    assert result.exit_code == 1 and "is in a directory that does not exist" in result.output
    good = _check({"cpu_gib": 1, "receipt_log_path": str(tmp_path / "r.jsonl")})
    assert good.exit_code == 0 and "ok: vLLM would start" in good.output, good.output


def test_a_shared_secret_file_that_is_a_directory_is_refused_with_the_node_tier(tmp_path):
    # the node tier reads shared_secret_file at start-up as the redis and s3 tiers do
    result = _check({"cpu_gib": 1, "node_socket": str(tmp_path / "node.sock"), "shared_secret_file": str(tmp_path)})
    assert result.exit_code == 1, result.output
    assert (f"error: kv_connector_extra_config.shared_secret_file: cannot read shared_secret_file {str(tmp_path)!r}: "
            "Is a directory; fix the path or its permissions") in result.output


@pytest.mark.parametrize("path", ["/proc/x", "/sys/r.jsonl"])
def test_a_receipt_log_path_that_cannot_be_opened_for_appending_is_refused_in_the_engines_words(path):
    """Fresh-user tester: ``/proc/x`` and ``/sys/r.jsonl`` passed check ("ok: vLLM would start"; as root
    ``os.access`` says yes everywhere) while the engine refuses them: check now opens as the engine does."""
    with pytest.raises(ConfigError) as engine:  # what the engine's receipt log does at start-up
        ReceiptLog(path, 1.0, 1 << 20, 2, 16).close()
    result = _check({"cpu_gib": 1, "receipt_log_path": path})
    assert result.exit_code == 1, result.output
    assert f"error: kv_connector_extra_config.receipt_log_path: {engine.value}" in result.output.splitlines()
    assert "ok: vLLM would start" not in result.output and "Traceback" not in result.output


def test_a_receipt_log_path_check_accepts_is_neither_created_nor_changed(tmp_path):
    """The open check leaves nothing behind: a missing file is not created, an existing one not written."""
    missing = tmp_path / "r.jsonl"
    assert _check({"cpu_gib": 1, "receipt_log_path": str(missing)}).exit_code == 0
    assert list(tmp_path.iterdir()) == []
    missing.write_text('{"old": 1}\n')
    before = missing.stat()
    assert _check({"cpu_gib": 1, "receipt_log_path": str(missing)}).exit_code == 0
    assert missing.read_text() == '{"old": 1}\n' and missing.stat().st_mtime_ns == before.st_mtime_ns


def test_a_node_socket_too_long_for_unix_is_an_error_of_check_and_of_the_engine(tmp_path):
    """A node_socket over 107 bytes was only a warning ("unreachable (OSError: AF_UNIX path too long)")
    and check said ok; no owner can ever listen there, so both check and the engine's config refuse it."""
    socket = str(tmp_path / ("x" * 120 + ".sock"))
    num_bytes = len(socket.encode())
    with pytest.raises(ConfigError, match=f"node_socket path is {num_bytes} bytes; a UNIX socket path holds at most"):
        KVTierConfig.from_dict({"node_socket": socket})
    result = _check({"cpu_gib": 1, "node_socket": socket})
    assert result.exit_code == 1, result.output
    assert (f"error: kv_connector_extra_config.node_socket: kvtier config field 'node_socket': node_socket path is "
            f"{num_bytes} bytes; a UNIX socket path holds at most 107: give a shorter path") in result.output
    assert "Traceback" not in result.output and "ok: vLLM would start" not in result.output
    assert KVTierConfig.from_dict({"node_socket": str(tmp_path / "n.sock")})  # a short one is kept
