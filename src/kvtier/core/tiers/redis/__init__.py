"""The redis tier: a shared tier of values on a Redis/Valkey server or Cluster (redis-py), one
value envelope per chunk, with a TTL.

Modules:

- :mod:`~kvtier.core.tiers.redis.tier`: the tier (data path);
- :mod:`~kvtier.core.tiers.redis.factory`: the tier from a configuration and its preflight check;
- :mod:`~kvtier.core.tiers.redis.stream`: pipelined ``SET``/``GET`` batches without redis-py's copies;
- :mod:`~kvtier.core.tiers.redis.client`: the redis-py client and the password;
- :mod:`~kvtier.core.tiers.redis.clear`: clearing one namespace on the server (a reset);
- :mod:`~kvtier.core.tiers.redis.failure`: what a failed request means, for the probe;
- :mod:`~kvtier.core.tiers.redis.settings`: the tier's configuration keys (its settings model);
- :mod:`~kvtier.core.tiers.redis.blobs`: the server as a blob store (purge, reset, probe).

Its plug-in object is :data:`kvtier.core.tiers.builtin.REDIS`.  Nothing is imported here (``redis``
stays optional until the tier is configured): a submodule is loaded only by the code that names it.
"""
