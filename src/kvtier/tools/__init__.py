"""Helpers shared by kvtier's operator tools (``kvtier bench``, ``doctor``, ``trace``, ``size``,
``simulate``), not part of the cache: bounded HTTP GETs (:mod:`~kvtier.tools.httpget`), Prometheus
scrapes (:mod:`~kvtier.tools.scrape`) and the Mooncake trace format (:mod:`~kvtier.tools.mooncake`).

Arrows point down: tools import :mod:`kvtier.core` (its errors); the core never imports tools.
"""
