"""``kvtier size``: KV bytes per token, the HBM KV budget, and the offload tier to buy.

Pipeline (each step a module, each result a typed value):

1. :func:`kvtier.size.models.resolve_model` -- name → :class:`~kvtier.size.geometry.KVGeometry`
   (local config.json, built-in preset from :mod:`kvtier.size.presets`, or the hub).
2. :func:`kvtier.size.plan.plan` -- geometry + :class:`~kvtier.size.plan.Deployment` (+ a trace's
   curve) → :class:`~kvtier.size.plan.SizeReport` (bytes per token whole-model and per rank, HBM
   budget, warm set, the cpu and disk tiers of :func:`kvtier.simulate.hierarchy.plan_tiers`: inclusive
   tiers, host RAM less reserves, NVMe).
3. :func:`kvtier.size.recipe.build_recipe` -- the tier as kvtier / vLLM-native / LMCache configs.

Nothing here mutates anything; all functions raise :class:`kvtier.core.errors.UserError` on bad input.
"""

from kvtier.core.dtypes import DTYPE_BYTES
from kvtier.size.geometry import KVGeometry, MLASpec, StateSpec
from kvtier.size.models import ResolvedModel, resolve_model
from kvtier.size.plan import Deployment, SizeReport, plan
from kvtier.size.recipe import Recipe, build_recipe

__all__ = [
    "DTYPE_BYTES", "Deployment", "KVGeometry", "MLASpec", "Recipe", "ResolvedModel", "SizeReport",
    "StateSpec", "build_recipe", "plan", "resolve_model",
]
