"""Layout detection, the block copy path and the rank service, on real tensors and sockets
(no engine): the copy must round-trip any layout whose block dimension is not the first."""

from __future__ import annotations

from multiprocessing import AuthenticationError
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import Namespace
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.copy import BlockCopier, Span
from kvtier.integrations.vllm.layout import detect_layout
from kvtier.integrations.vllm.protocol import RequestKeys
from kvtier.integrations.vllm.service import RankService, ServiceClient, ServiceServer, authkey_for, connect

NUM_BLOCKS = 12
# name -> per-layer shape with NUM_BLOCKS somewhere, and where the blocks are
LAYOUTS = {
    "cpu [blocks, heads, block, 2*head]": ((NUM_BLOCKS, 2, 16, 128), 0),
    "flash [2, blocks, block, heads, head]": ((2, NUM_BLOCKS, 16, 2, 64), 1),
    "mla [blocks, block, latent]": ((NUM_BLOCKS, 16, 96), 0),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_blocks_round_trip_through_pages(name: str) -> None:
    shape, block_dim = LAYOUTS[name]
    gen = torch.Generator().manual_seed(0)
    src = {f"layer.{i}": torch.randn(*shape, generator=gen, dtype=torch.float32) for i in range(3)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    assert layout.block_dim == block_dim
    assert layout.num_layers == 3
    k = 4  # blocks per chunk
    pages = [np.zeros(layout.chunk_bytes(k), dtype=np.uint8) for _ in range(2)]
    # chunk 0 <- blocks 7,1,9,3 ; chunk 1 <- blocks 5,11 into slots 2,3 (a partial chunk)
    BlockCopier(layout, src, k).save([Span(pages[0], 0, [7, 1, 9, 3]), Span(pages[1], 2, [5, 11])])
    assert pages[1][: layout.block_bytes].sum() == 0  # untouched slots stay as they were
    # load into other blocks of a fresh cache: 7->0, 1->2, 9->4, 3->6, 5->8, 11->10
    BlockCopier(layout, dst, k).load([Span(pages[0], 0, [0, 2, 4, 6]), Span(pages[1], 2, [8, 10])])
    for name_, t in src.items():
        for s, d in [(7, 0), (1, 2), (9, 4), (3, 6), (5, 8), (11, 10)]:
            assert torch.equal(dst[name_].select(block_dim, d), t.select(block_dim, s))
        for d in (1, 3, 5, 7, 9, 11):
            assert not dst[name_].select(block_dim, d).any()


def test_layout_errors_are_one_sentence() -> None:
    with pytest.raises(ConfigError, match="no dimension"):
        detect_layout({"a": torch.zeros(3, 4)}, 12, "TEST")
    with pytest.raises(ConfigError, match="uniform"):
        detect_layout({"a": torch.zeros(12, 4), "b": torch.zeros(12, 5)}, 12, "TEST")


def _store(tmp_path: Path) -> TieredStore:
    ns = Namespace(model="m", kv_dtype="float32", num_layers=1, num_kv_heads=1, head_size=8, layout="test",
                   chunk_tokens=4)
    cfg = KVTierConfig.from_dict({"chunk_tokens": 4, "cpu_gib": 1 / 1024, "disk_path": str(tmp_path), "disk_gib": 0.01})
    return TieredStore(cfg, ns, chunk_bytes=64)


def test_rank_service_over_a_socket_pins_and_releases(tmp_path: Path) -> None:
    store = _store(tmp_path / "disk")
    service = RankService(store)
    keys = RequestKeys(tuple(range(13)), cache_salt="s")
    chain = service.chain(keys)
    assert len(chain) == 3
    store.put(chain[:2], [bytes([i]) * 64 for i in range(2)])
    address = str(tmp_path / "svc.sock")
    server = ServiceServer(service, address, authkey_for("engine-x"))
    try:
        assert connect(address, authkey_for("engine-x")) is service  # same process: no socket
        client = ServiceClient(address, authkey_for("engine-x"))
        assert client.pin("r1", keys, 3) == ("cpu", "cpu")
        assert client.pin("r1", keys, 3) == ("cpu", "cpu")  # asked again: the same pin, not a second one
        assert service.num_pinned_requests() == 1
        assert client.pin("r2", RequestKeys(tuple(range(13)), cache_salt="other"), 3) == ()
        with pytest.raises(RuntimeError, match="requests still hold pins"):
            client.check_integrity()
        client.release("r1")
        client.check_integrity()
        handle_free = service.take("r1")
        assert handle_free is None
        wrong = ServiceClient(address, authkey_for("engine-y"), connect_timeout_s=0.5)
        with pytest.raises(AuthenticationError):
            wrong.stats()  # a process without the engine's key is refused
        client.close()
    finally:
        server.close()
        store.close()
