#!/bin/bash
# production launch
export LMCACHE_LOCAL_CPU=True
export LMCACHE_MAX_LOCAL_CPU_SIZE=80
vllm serve google/gemma-3-27b-it \
  --tensor-parallel-size 2 \
  --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1",
                         "kv_role":"kv_both"}' \
  --max-model-len 65536
