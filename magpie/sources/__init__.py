"""Proxy-list sources: URLs fetched on a schedule and imported into a workspace (docs/sources.md)."""
