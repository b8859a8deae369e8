"""``kvtier check`` where a configured tier's client package cannot be imported: an error naming the
package and the extra that installs it, exit 1 (issue 34: in an image without obstore it said "ok:
vLLM would start" for an s3 tier, whose start-up then failed).  The package is made unimportable in
the child process (``sys.modules[name] = None``, Python's documented way to make an import fail)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli.test_check_shared_tier_probe import transfer
from tests.redis_servers import free_port

RUN = "import sys; sys.modules[{package!r}] = None; from kvtier.cli.main import app; sys.argv[0] = 'kvtier'; app()"


def check_without(package: str | None, config: dict[str, object]) -> subprocess.CompletedProcess[str]:
    code = RUN.format(package=package) if package else RUN.replace("sys.modules[{package!r}] = None; ", "")
    return subprocess.run([sys.executable, "-c", code, "check", json.dumps(config)], capture_output=True, text=True,
                          check=False, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin:/bin",
                                                        "PYTHONPATH": ":".join(sys.path)})


@pytest.mark.parametrize(("tier", "package", "key", "extra"), [
    ("s3", "obstore", "s3_bucket", {"s3_bucket": "kvtier-bench", "s3_endpoint_url": "https://s3.example.com"}),
    ("redis", "redis", "redis_url", {"redis_url": "redis://127.0.0.1:{port}/0"}),
])
def test_a_tier_whose_client_does_not_import_is_an_error(tier: str, package: str, key: str,
                                                         extra: dict[str, str]):
    values = {k: v.format(port=free_port()) for k, v in extra.items()}
    config = transfer({**values, "tiers": ["cpu", tier]})
    missing = check_without(package, config)
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert [line for line in missing.stdout.splitlines() if not line.startswith("info: ")] == [
        (f"error: kv_connector_extra_config.{key}: the {tier} tier needs the Python package '{package}', which is "
        f"not installed here; install it (pip install 'kvtier[{tier}]'; deploy/Dockerfile's image has every "
        f"tier's client) or remove the {tier} tier from the config")], missing.stdout
    present = check_without(None, config)  # the same config where the package imports: no such error
    assert f"needs the Python package '{package}'" not in present.stdout, present.stdout
