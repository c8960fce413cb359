"""Derived data: route reputation, workspace timelines and rollups, import-source statistics.

Everything here is computed by maintenance jobs from data ingestion already stored (``route_health``,
``check_history``), never on the check path: :mod:`magpie.derived.reputation` (scores of routes marked
dirty by ingestion), :mod:`magpie.derived.rollups` (snapshots, hourly counts, source statistics, workspace
usage) and :mod:`magpie.derived.retention` (one retention job per rollup table). Tables:
:mod:`magpie.derived.models`. Formulas: docs/derived-data.md.
"""
