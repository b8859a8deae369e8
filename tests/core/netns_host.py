"""One "host" of the two-host test: a store with a redis tier, run inside a network namespace.

    python -m tests.core.netns_host save|load REDIS_URL KEY_PREFIX PROMPT NUM_CHUNKS

``save`` stores the prompt's chunks and waits for the redis writes; ``load`` asks the shared tier
(one presence batch, as the scheduler asks), loads what it found and checks every byte.  Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from tests.core.helpers import chain_of, make_store, payload, shared_prefix


def main(argv: list[str]) -> int:
    role, url, prefix, prompt, num = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    store = make_store(None, cpu_chunks=32, redis_url=url, redis_key_prefix=prefix, shared_deadline_s=5.0,
                       redis_timeout_s=5.0, redis_connect_timeout_s=2.0)
    chain = chain_of(prompt, num)
    out: dict[str, object] = {"role": role}
    if role == "save":
        out["stored"] = store.put(chain, [payload(k) for k in chain])
        out["flushed"] = store.flush(30)
        out["skipped_writes"] = store.tier("redis").skipped_writes  # type: ignore[union-attr]
    else:
        out["local"] = store.lookup(chain)
        found = shared_prefix(store, chain)
        handle = store.prepare_load(chain, max_chunks=found)
        out["found"] = found
        out["tiers"] = handle.tiers
        out["exact"] = [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain[:handle.num_chunks]]
        store.complete_load(handle, True)
    store.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
