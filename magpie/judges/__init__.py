"""Judge pools, check profiles and the caches checkers keep of them; failure tracking and ownership.

* :mod:`magpie.judges.store`: the tables (judges, profiles, the config revision) and their changes;
* :mod:`magpie.judges.cache`: a process's in-memory copy, following changes (pub/sub plus reconcile);
* :mod:`magpie.judges.plan` and :mod:`magpie.judges.checking`: which checks a route gets and running them
  with judge failover on the check engine;
* :mod:`magpie.judges.dns`: the bounded DNS cache the engine resolves through;
* :mod:`magpie.judges.refresh`, :mod:`magpie.judges.ownership`: the maintenance jobs;
* :mod:`magpie.judges.failures`: per (workspace, route) failure streaks in the ingestion transaction.
"""
