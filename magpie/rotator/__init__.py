"""Rotating listeners: a proxy endpoint per workspace that forwards each client connection through the
workspace's healthy routes.

- :mod:`magpie.rotator.models` / :mod:`magpie.rotator.service`: rotators as data (``rotators`` table,
  port range, credentials encrypted at rest, filters, rotation policy, assigned instance, revision);
- :mod:`magpie.rotator.pool`: the eligible routes of a rotator, read from current route health;
- :mod:`magpie.rotator.listener`: the asyncio listener (HTTP proxy with CONNECT, SOCKS5) and its
  upstream tunnels (python-socks);
- :mod:`magpie.rotator.process`: the ``magpie rotator`` process: instance heartbeat, the leader-locked
  assigner, and the reconcile loop that starts, stops and updates listeners.
"""
