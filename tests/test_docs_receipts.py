"""docs/receipts.md shows receipts as the engine writes them: every JSON receipt on the page decodes
with kvtier's own decoder (:func:`kvtier.core.receipt.decode`), encodes back to exactly the same
object (every field the engine writes, ``top_miss`` included, none it does not), and its token counts
add up as the page says they do."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtier.core.receipt import decode

DOC = Path(__file__).resolve().parents[1] / "docs" / "receipts.md"


def json_blocks() -> list[object]:
    """Every fenced ``json`` block of the page, parsed."""
    return [json.loads(body) for body in re.findall(r"```json\n(.*?)\n```", DOC.read_text(), re.DOTALL)]


def documented_receipts() -> list[dict[str, object]]:
    """The receipts the page shows: a block that is one, or the ``kvtier`` object of a response."""
    found: list[dict[str, object]] = []
    for block in json_blocks():
        assert isinstance(block, dict)
        params = block.get("kv_transfer_params")
        found.append(params["kvtier"] if isinstance(params, dict) else block)
    return found


def test_every_receipt_on_the_page_is_one_the_engine_writes():
    receipts = documented_receipts()
    assert len(receipts) == 3, "the response, the purged receipt and the receipt log line"
    for shown in receipts:
        receipt = decode(shown)
        # the engine writes Receipt.to_builtins(): every field, in this order
        assert list(receipt.to_builtins().items()) == list(shown.items()), shown["request_id"]
        assert sum(receipt.tokens.values()) == receipt.prompt_tokens, shown["request_id"]
        if receipt.miss is not None:  # the served prefix ends where the first miss is
            assert receipt.miss.token == receipt.cached_tokens(), shown["request_id"]


def test_the_response_counts_the_receipts_cached_tokens():
    response = next(b for b in json_blocks() if isinstance(b, dict) and "usage" in b)
    receipt = decode(response["kv_transfer_params"]["kvtier"])
    assert response["usage"]["prompt_tokens"] == receipt.prompt_tokens
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == receipt.cached_tokens()
