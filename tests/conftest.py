"""Shared fixtures for the kvtier test suite."""
