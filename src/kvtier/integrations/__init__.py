"""Engine integrations of kvtier (one subpackage per engine)."""
