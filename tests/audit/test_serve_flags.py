"""The table of ``vllm serve`` options that ``kvtier audit``'s flag rules read
(``kvtier/data/vllm_serve_flags.json``) is the installed vLLM's own parser, option by option, and a
line the fresh-user tester wrote (a misspelled ``--kv-transfer-config``; a flag without its value, a
length that is no number, a flag vLLM never had) is refused as vLLM's parser refuses it."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version

ROOT = Path(__file__).resolve().parents[2]


def test_the_bundled_table_is_the_installed_vllms_parser():
    vllm = pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from vllm_serve_flags import serve_flags
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    bundled = json.loads((resources.files("kvtier") / "data" / "vllm_serve_flags.json").read_text())
    assert bundled["vllm"] == vllm.__version__, "regenerate: python scripts/vllm_serve_flags.py"
    assert bundled == serve_flags(), "regenerate: python scripts/vllm_serve_flags.py"


CASES = [
    (["m", "--kv-transfer-confg", "{}"], "serve-flag-unknown"),
    (["m", "--frobnicate", "3"], "serve-flag-unknown"),
    (["m", "--max-model-len", "abc"], "serve-flag-value"),
    (["m", "--dtype", "fp7"], "serve-flag-value"),
    (["m", "--max-num-batched-tokens", "1.5K"], "serve-flag-value"),
    (["m", "--max-model-len", "32k", "--max-num-batched-tokens", "8K", "-tp", "1", "--max_num_seqs", "8"], None),
]


@pytest.fixture(scope="module")
def refused_by_vllm() -> list[bool]:
    """Per case, whether vLLM's own parser refuses ``vllm serve`` with its words (argparse's usage
    error, exit 2), in one child process (one import of vLLM)."""
    pytest.importorskip("vllm")
    code = ("import json, sys\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "out = []\n"
            "for words in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        make_arg_parser(FlexibleArgumentParser()).parse_args(words)\n"
            "        out.append(False)\n"
            "    except SystemExit as exc:\n"
            "        out.append(exc.code == 2)\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([w for w, _ in CASES])], capture_output=True,
                          text=True, timeout=300, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_what_the_rules_refuse_vllms_parser_refuses(case: int, refused_by_vllm: list[bool]):
    words, rule = CASES[case]
    findings = {f.rule for f in audit(load_configs("vllm serve " + " ".join(words), "line.sh", parse_version("0.32.0")))}
    assert (rule in findings) if rule else not findings & {"serve-flag-unknown", "serve-flag-value"}
    assert refused_by_vllm[case] == (rule is not None), words


def test_a_container_running_kvtiers_own_cli_in_the_vllm_image_is_no_vllm_server():
    """The node pool's owner runs ``kvtier node serve --pool ...`` in the kvtier-vllm image: read as a vLLM
    server, its flags were "not flags of vllm serve"."""
    from kvtier.audit.parse_k8s import is_vllm

    owner = {"image": "registry.example.com/kvtier-vllm:v0.32.0", "command": ["kvtier", "node", "serve"],
             "args": ["--pool", "/dev/shm/kvtier", "--node-gib", "8"]}
    server = {"image": "registry.example.com/kvtier-vllm:v0.32.0", "command": ["vllm", "serve"], "args": ["m"]}
    assert not is_vllm(owner, "owner") and is_vllm(server, "server")
