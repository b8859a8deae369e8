"""The three input kinds (command line, env file, Kubernetes manifest) are read correctly."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version, version_from_image
from kvtier.core.errors import UserError

DATA = Path(__file__).parent / "data"


def test_shell_script_with_exports_continuations_and_multiline_json():
    (config,) = load_configs((DATA / "serve.sh").read_text(), "serve.sh")
    assert config.model == "google/gemma-3-27b-it"
    assert config.tp == 2
    assert config.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "80"
    assert config.connectors == ["LMCacheConnectorV1"]
    assert config.number("--max-model-len") == 65536
    rules = {f.rule for f in audit([config])}
    assert "lmcache-inprocess-on-hybrid" in rules


def test_deployment_reads_args_env_and_image_tag_and_skips_sidecars():
    configs = load_configs((DATA / "deployment.yaml").read_text(), "deployment.yaml")
    assert len(configs) == 1
    (config,) = configs
    assert config.origin == "deployment.yaml:Deployment/llama/vllm"
    assert config.version == Version("0.32.0")
    assert config.tp == 4 and config.model == "meta-llama/Llama-3.1-70B-Instruct"
    assert config.env == {"LMCACHE_MAX_LOCAL_CPU_SIZE": "200"}  # valueFrom cannot be resolved offline
    findings = {f.rule: f for f in audit(configs)}
    assert "lmcache-size-mismatch" in findings  # 200 per rank × 4 ≠ 200 total
    assert findings["lmcache-size-mismatch"].line == (DATA / "deployment.yaml").read_text().splitlines().index(
        "            - name: LMCACHE_MAX_LOCAL_CPU_SIZE") + 1
    assert "disable-hma-by-reflex" not in findings  # LMCacheConnectorV1 lacks HMA: the flag is not harmful


def test_statefulset_with_sh_c_and_cuda12_tag():
    (config,) = load_configs((DATA / "statefulset-shell.yaml").read_text(), "sts.yaml")
    assert config.version == Version("0.27.1")
    assert config.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    rules = {f.rule for f in audit([config])}
    assert {"calculate-kv-scales-no-effect", "mrv2-early-opt-in", "cpu-offload-gb-is-weights"} <= rules


def test_version_flag_overrides_the_image_tag():
    (config,) = load_configs((DATA / "statefulset-shell.yaml").read_text(), "sts.yaml", Version("0.28.0"))
    assert "calculate-kv-scales-removed" in {f.rule for f in audit([config])}


def test_env_file():
    (config,) = load_configs((DATA / "lmcache.env").read_text(), "lmcache.env")
    assert config.env["LMCACHE_LOCAL_DISK"] == "file:///mnt/nvme/lmcache/"
    rules = {f.rule for f in audit([config])}
    assert {"lmcache-local-cpu-off", "lmcache-disk-async-loading"} <= rules


def test_pod_and_list_kinds():
    pod = """apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
    - name: c
      image: vllm/vllm-openai:v0.22.0
      args: ["--model", "m", "--kv-offloading-size", "8"]
"""
    (config,) = load_configs(pod, "pod.yaml")
    assert config.version == Version("0.22.0") and config.connectors == ["OffloadingConnector"]
    wrapped = "apiVersion: v1\nkind: List\nitems:\n" + "".join(("    " if i else "  - ") + ln + "\n"
                                                                for i, ln in enumerate(pod.splitlines()))
    assert len(load_configs(wrapped, "list.yaml")) == 1


def test_underscore_and_equals_flag_spellings():
    (config,) = load_configs("vllm serve m --kv_offloading_size=16 --tensor_parallel_size 2", "x")
    assert config.number("--kv-offloading-size") == 16 and config.tp == 2


def test_python_module_entrypoint():
    (config,) = load_configs("python3 -m vllm.entrypoints.openai.api_server --model m --cpu-offload-gb 4", "x")
    assert config.model == "m"


@pytest.mark.parametrize("tag, version", [
    ("vllm/vllm-openai:v0.26.0", "0.26.0"), ("vllm/vllm-openai:v0.32.0-cu129", "0.32.0"),
    ("registry:5000/vllm/vllm-openai:0.29.0", "0.29.0"), ("vllm/vllm-openai:latest", None),
    ("vllm/vllm-openai:glm51-cu130", None), ("vllm/vllm-openai", None), ("vllm/vllm-openai@sha256:abc", None),
])
def test_version_from_image(tag, version):
    assert version_from_image(tag) == (Version(version) if version else None)


@pytest.mark.parametrize("text", ["latest", "0.x", "v", "1..2", "zero point three"])
def test_bad_version_strings_are_user_errors(text):
    with pytest.raises(UserError, match="not a version"):
        parse_version(text)


@pytest.mark.parametrize("text, words", [
    ("kind: Deployment\nspec: [unclosed\n", "not valid YAML"),
    ("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n", "no container running vLLM"),
    ("vllm serve m --kv-transfer-config '{unterminated", "quotes"),
    ("just some prose\nwith no command\n", "neither"),
    ("   \n", "empty"),
    ("kind: Pod\nspec:\n  containers:\n  - name: v\n    command: [vllm, serve, [m]]\n",
     "must be a list of strings, but one item is a list: \\['m'\\]"),
])
def test_unreadable_inputs_are_user_errors(text, words):
    with pytest.raises(UserError, match=words):
        load_configs(text, "input")


def test_docker_run_of_the_kvtier_image_is_audited():
    """deploy.md builds ``registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0`` (vLLM's image, its
    ``vllm serve`` entrypoint kept) for ``docker run``; a ``docker run`` line of it was refused as "neither a
    vllm serve command line ..." (exit 2): only ``vllm-openai`` images were read.  The image is the first
    word after ``run`` past the options and their values, so ``-v /data/vllm-cache:…`` is not it."""
    line = ("docker run --gpus all -p 8000:8000 -v /data/vllm-cache:/root/.cache --rm -it "
            "-e VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=35 registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0 "
            "Qwen/Qwen3-8B --tensor-parallel-size 2 --shutdown-timeout 30")
    (config,) = load_configs(line, "run.sh")
    assert config.image == "registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0"
    assert config.version == Version("0.32.0")
    assert config.model == "Qwen/Qwen3-8B" and config.tp == 2
    assert config.env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "35"
    (podman,) = load_configs(line.replace("docker run", "podman container run").replace(":v0.32.0-kvtier0.1.0", ":0.1.0"),
                             "run.sh")
    assert podman.image == "registry.example.com/kvtier-vllm:0.1.0" and podman.version is None  # kvtier's own version
    with pytest.raises(UserError, match="no `vllm serve` command, vLLM image"):
        load_configs("docker run -v /data/vllm:/data --name vllm-redis redis:7 --port 6380", "run.sh")
