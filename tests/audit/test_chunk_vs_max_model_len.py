"""``kvtier-chunk-tokens-not-below-max-model-len`` (user41's review): a serve line whose chunk_tokens
no prompt can exceed got "No findings", yet kvtier serves it no hit.  The rule reads chunk_tokens as
the connector does: from the JSON, else ``KVTIER_CHUNK_TOKENS``, and ``auto`` (the default) as at least 128."""

from __future__ import annotations

import pytest

from tests.audit.test_rules import _findings_on, kvtier_line

RULE = "kvtier-chunk-tokens-not-below-max-model-len"


@pytest.mark.parametrize("line, fires", [
    (kvtier_line(cpu_gib=4) + " --max-model-len 128", True),  # auto: at least 128
    (kvtier_line(cpu_gib=4) + " --max-model-len 129", False),
    (kvtier_line(cpu_gib=4, chunk_tokens="auto") + " --max-model-len 64", True),
    ("KVTIER_CHUNK_TOKENS=512 " + kvtier_line(cpu_gib=4) + " --max-model-len 512", True),
    ("KVTIER_CHUNK_TOKENS=512 " + kvtier_line(cpu_gib=4) + " --max-model-len 4096", False),
    (kvtier_line(cpu_gib=4, chunk_tokens=256), False),  # no --max-model-len: the model's own, unknown here
])
def test_the_rule_reads_chunk_tokens_as_the_connector_does(line, fires):
    found = _findings_on(line, None)
    assert (RULE in found) is fires, found
    if fires:
        assert "serves no hit" in found[RULE] and "--max-model-len" in found[RULE]
