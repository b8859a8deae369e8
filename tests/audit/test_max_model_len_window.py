"""``max-model-len-beyond-model-window`` (user41's review): a serve line whose --max-model-len is past a
local model's window had no findings, and vLLM refused it at start-up; vLLM's override variable and a
model the audit cannot read (a hub id, a path on another host) stay quiet."""

from __future__ import annotations

from tests.audit.test_rules import WINDOW_MODEL, _findings_on

RULE = "max-model-len-beyond-model-window"


def test_the_window_rule_fires_on_a_local_model_only_and_honours_vllms_override():
    found = _findings_on(f"vllm serve {WINDOW_MODEL} --max-model-len 8192", None)
    assert "4096 tokens (max_position_embeddings in its config.json): vLLM refuses to start" in found[RULE]
    assert RULE not in _findings_on(f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve {WINDOW_MODEL} --max-model-len 8192",
                                    None)
    assert RULE not in _findings_on("vllm serve /models/not-on-this-host --max-model-len 8192", None)
    assert RULE not in _findings_on("vllm serve my-org/my-model --max-model-len 8192", None)
