"""Regression tests for ``kvtier audit`` inputs found by the breaker: every bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from packaging.version import Version

from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version, version_from_image
from kvtier.cli.audit import _read_input
from kvtier.core.errors import UserError


def kvtier(*args: str, stdin: str | bytes | None = None, close_stdin: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", *args],
                          input=stdin.encode() if isinstance(stdin, str) else stdin,
                          stdin=subprocess.DEVNULL if close_stdin is False and stdin is None else None,
                          capture_output=True, check=False, timeout=60,
                          env={"COLUMNS": "200", "PATH": "/usr/bin",  # the kvtier under test, not another install
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})


def _one_line_exit_2(proc: subprocess.CompletedProcess, words: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert "Traceback" not in err


LAUGHS = "\n".join(
    ["apiVersion: v1", "kind: Pod", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    + ["spec: {containers: [{image: vllm/vllm-openai:v0.30.0, args: *a8}]}", ""])


@pytest.mark.parametrize("name, text, words", [
    ("deep.sh", "vllm serve m --kv-transfer-config '" + "[" * 5000 + "]" * 5000 + "'", "nested too deeply"),
    ("deep.yaml", "apiVersion: v1\nkind: Pod\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("spec.yaml", 'apiVersion: v1\nkind: Pod\nspec: "nope"\n', "spec must be a mapping"),
    ("laughs.yaml", LAUGHS, "expands to more than"),
    ("recursive.yaml", "apiVersion: v1\nkind: Pod\nspec: &s {x: *s}\n", "recursive alias"),
    ("args.yaml", ("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - image: vllm/vllm-openai:v0.32.0\n"
                  "    args: {a: 1}\n"), "args must be a list"),
])
def test_malformed_inputs_exit_2_with_one_line(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    _one_line_exit_2(kvtier(str(path)), words)


def test_binary_file_is_named_not_text(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00")
    _one_line_exit_2(kvtier(str(path)), "is not text")


def test_closed_stdin_exits_2():
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", "-"], preexec_fn=lambda: os.close(0),
                          capture_output=True, check=False, timeout=60)  # like `kvtier audit - <&-`
    _one_line_exit_2(proc, "stdin is closed")


def test_string_command_is_split_like_a_shell():
    text = ("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - image: vllm/vllm-openai:v0.32.0\n"
            '    command: "vllm serve Qwen/Qwen3-8B --cpu-offload-gb 40"\n')
    (config,) = load_configs(text, "pod.yaml")
    assert config.model == "Qwen/Qwen3-8B"
    assert config.value("--cpu-offload-gb") == "40"


@pytest.mark.parametrize("image, version", [
    ("vllm/vllm-openai:v0.20.0@sha256:0123abcd", "0.20.0"),
    ("vllm/vllm-openai:v0.32.0-cu129", "0.32.0"),
    ("vllm/vllm-openai:0.22.0rc1", "0.22.0rc1"),
    ("vllm/vllm-openai@sha256:0123abcd", None),
    ("vllm/vllm-openai:latest", None),
])
def test_image_tag_version_survives_a_digest(image, version):
    assert version_from_image(image) == (Version(version) if version else None)


@pytest.mark.parametrize("text", ["0.22.1+cu129", "0.22.0.dev0", "0.22.1rc2.dev123+gabcdef", "v0.32.0"])
def test_vllm_version_accepts_pep440_build_strings(text):
    assert parse_version(text) == Version(text)
    proc = kvtier("-", "--vllm-version", text, "--format", "json", stdin="vllm serve Qwen/Qwen3-8B\n")
    assert proc.returncode in (0, 1) and proc.stderr == b"", proc.stderr  # 0.22.0.dev0 predates the 0.22.0 floor
    assert "findings" in json.loads(proc.stdout)



@pytest.mark.parametrize("path", ["/dev/zero", "/proc/kmsg"])
def test_a_device_or_kernel_file_is_refused_before_reading(path):
    """A device (/dev/zero) or a kernel file (/proc/kmsg, a 'regular' file of procfs) blocks a read
    or never ends: refused up front."""
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this host")
    outcome = _read_in_thread(path)
    assert isinstance(outcome, UserError) and "is not a file of text" in str(outcome), outcome


def test_a_pipe_is_read_and_a_named_pipe_nobody_writes_reads_as_empty(tmp_path):
    """`kvtier audit <(cmd)` reads a pipe; a named pipe with no writer ends at once (empty), never blocks."""
    idle = tmp_path / "idle.fifo"
    os.mkfifo(idle)
    assert _read_in_thread(str(idle)) == ("", str(idle))
    fed = tmp_path / "fed.fifo"
    os.mkfifo(fed)
    text = "vllm serve Qwen/Qwen3-8B\n"

    def write() -> None:
        with open(fed, "w") as handle:  # waits for the reader, as `<(cmd)`'s writer does
            handle.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    deadline = time.monotonic() + 10
    got: BaseException | tuple[str, str] = ("", "")
    while time.monotonic() < deadline:  # the reader may open before the writer: read until the text is in
        got = _read_in_thread(str(fed))
        if got != ("", str(fed)):
            break
    assert got == (text, str(fed)), got
    writer.join(timeout=10)


def _read_in_thread(path: str) -> BaseException | tuple[str, str]:
    """``_read_input(path)`` on a thread, at most 10 s (a blocked read fails the test instead of hanging it)."""
    outcome: list[BaseException | tuple[str, str]] = []

    def read() -> None:
        try:
            outcome.append(_read_input(path))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)  # a blocked open() cannot be cancelled: let it die with us
    reader.start()
    reader.join(timeout=10)
    assert outcome, f"reading {path} blocked"
    return outcome[0]
