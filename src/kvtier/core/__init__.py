"""Engine-independent core of kvtier: chunk keys, tiers, eviction policies, the tiered store,
configuration and metrics.  Nothing in this package imports vLLM or torch."""
