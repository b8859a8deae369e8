"""A test-only vLLM connector that declares ``SupportsHMA``, moves no bytes, and records what
vLLM hands a hybrid-aware connector: the registered caches as kvtier's per-group layouts, each
group's block ids after allocation and at every step, vLLM's boundary-state hand-offs and the
``request_finished_all_groups`` call.  Loaded by hybrid_probe.py through
``kv_connector_module_path``; the record goes to the JSON-lines file in ``HMA_RECORD``."""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


def _record(**event: Any) -> None:
    with open(os.environ["HMA_RECORD"], "a") as f:
        f.write(json.dumps(event) + "\n")


class HMARecorder(KVConnectorBase_V1, SupportsHMA):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvtier.integrations.vllm.worker.layout import detect_group_layouts

        layouts = detect_group_layouts(kv_caches, self._kv_cache_config, lambda name: "probe")
        _record(event="layouts", layouts={str(i): {"layers": list(x.layer_names), "block_dim": x.block_dim,
                                                  "block_bytes": x.block_bytes, "dtype": str(x.dtype)}
                                          for i, x in layouts.items()})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        _record(event="alloc", req=request.request_id, block_ids=[list(x) for x in blocks.get_block_ids()])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        state = scheduler_output.kv_connector_block_state
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            ids = state.resolve_block_ids(req_id) if state is not None and req_id in state.req_ids else None
            handoffs = state.boundary_state_offloads.get(req_id, []) if state is not None else []
            _record(event="step", req=req_id, num_scheduled=num_scheduled,
                    block_ids=[list(x) for x in ids] if ids is not None else None,
                    handoffs=[list(h) for h in handoffs])
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        _record(event="finished", req=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                block_ids=[list(x) for x in block_ids])
        return False, None
