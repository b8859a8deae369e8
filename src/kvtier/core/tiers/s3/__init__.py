"""The s3 tier: a shared tier of objects in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW,
Cloudflare R2) on obstore, one value envelope per object.

Modules:

- :mod:`~kvtier.core.tiers.s3.tier`: the tier (data path);
- :mod:`~kvtier.core.tiers.s3.factory`: the tier from a configuration, its preflight check and advice;
- :mod:`~kvtier.core.tiers.s3.objects`: object keys and the event loop requests run on;
- :mod:`~kvtier.core.tiers.s3.space`: the count, TTL sweep and cap;
- :mod:`~kvtier.core.tiers.s3.conditional`: the ``If-None-Match`` probe;
- :mod:`~kvtier.core.tiers.s3.client`: the obstore client and its credentials;
- :mod:`~kvtier.core.tiers.s3.settings`: the tier's configuration keys (its settings model);
- :mod:`~kvtier.core.tiers.s3.blobs`: the bucket as a blob store (purge, reset, probe).

Its plug-in object is :data:`kvtier.core.tiers.builtin.S3`.  Nothing is imported here (``obstore``
stays optional until the tier is configured): a submodule is loaded only by the code that names it.
"""
