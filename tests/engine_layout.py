"""The process layout of the vLLM engines the tests start.

vLLM's CPU platform runs an api_server as three processes: the API server, the engine core, and the
worker (the ``mp`` executor, started with ``spawn``; vllm/platforms/cpu.py, v0.32.0, ``OMP requires
the MP executor``), unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: then the worker runs inside the
engine-core process (the ``uni`` executor) and the server starts one import of torch and vLLM
sooner.  Measured on the 2-core CI machine kind (one api_server: the tiny test model,
tests/integrations/vllm_helpers.py's live_spec, a kvtier cpu tier; the two layouts alternating): 34.6
and 42.7 s to the first answer with the default layout, 23.2 and 25.2 s with the worker in the
engine core, the same greedy completions.  tests/integrations/engine_runner.py runs the engine
core in its own process and, by default, the worker in another (``mp``); :data:`WORKER_IN_RUNNER`
puts the worker in the runner's process too.

In both in-process layouts the scheduler-side and worker-side connectors are still two objects that
meet only through vLLM's per-step messages (``build_connector_meta``, the worker's
``get_finished``/``kv_connector_stats``), but a bug that shows only when they live in different
processes (state one half keeps at module level and the other reads, a pickled message, a signal
that reaches one process and not the other) would pass there.  So an engine keeps vLLM's default
layout where its subject is the process split, and every tier family is loaded by at least one
engine whose halves are in separate processes:

- the process split, lifecycles and signals: test_vllm_processes.py (graceful stop, a running
  consumer, tensor-parallel ranks), test_vllm_serve.py (SIGTERM's write-back flush, the restart
  from the disk tier, the clean SIGTERM stop), test_vllm_demo.py (``kvtier demo``'s SIGTERM restart);
- loads with the halves apart, per tier family: cpu and disk (test_vllm_serve.py, test_vllm_processes.py,
  test_vllm_demo.py), node (test_vllm_node_tier.py, also SIGKILLed during a load), redis
  (test_vllm_redis_tier.py's engine B), s3 (test_vllm_s3_tier.py's restarted engine B), hybrid models' KV cache groups
  (test_vllm_hybrid_kvtier.py's third test, every geometry).

Servers compared bit for bit within one test share one layout: an api_server with its worker in the
engine core does not compute a default-layout server's float32 logprobs exactly (measured: with
test_vllm_node_tier.py's engine A moved to the engine core, B's answer over A's KV differed from
A's own in the last bits).  engine_runner.py's ``uni`` and ``mp`` engines did agree bit for bit
(test_vllm_s3_tier.py's and test_vllm_redis_tier.py's engines A against their engine B).

Everything else runs its worker in the engine core (:data:`WORKER_IN_ENGINE_CORE`) or in the
runner (:data:`WORKER_IN_RUNNER`): the operator tools (bench, doctor, ``trace record``: their
subject is what the tool reads and reports), the receipts walk, the redis fault workload, the
engines that only compute, save and serve as the exact reference (s3 A, redis A), the engines that
load through a slow link or a short deadline (redis C and D), the encrypted restarts,
test_vllm_processes.py's producer (the running consumer it feeds keeps its halves apart) and its engine
started after the weights were replaced (the identity fence reads the model directory's files), the first
two hybrid-model tests and test_vllm_two_hosts.py's three servers (its subject is the network
between hosts; one layout for the three, compared bit for bit; measured alone on this machine kind,
load 3.3-6.9: 93 s with the default layout, 61 s so).  (test_vllm_engine.py's engine runs in the test's own process, so that its
tests can reach the worker's store.)
"""

from __future__ import annotations

WORKER_IN_ENGINE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment of a server whose worker runs in its engine-core process (see the module docstring)."""

WORKER_IN_RUNNER = {"distributed_executor_backend": "uni"}
"""``engine`` settings of an ``engine_runner.py`` spec whose worker runs in the runner's process (vLLM's
``uni`` executor, allowed on the CPU platform with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which
tests/integrations/vllm_helpers.py's ``run_engine`` sets; see the module docstring)."""
