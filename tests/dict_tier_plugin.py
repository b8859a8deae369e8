"""Registers the toy dict tier (:mod:`tests.dict_tier`): the module a configuration names in
``tier_modules`` (``"tier_modules": ["tests.dict_tier_plugin"]``), imported by kvtier in every
process that reads the configuration."""

from kvtier.core.tiers.registry import register
from tests.dict_tier import SPEC

register(SPEC)
