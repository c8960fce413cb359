"""Leaf helpers every part may use; they import nothing of magpie above :mod:`magpie.errors` and
:mod:`magpie.config`: the route type (:mod:`.routes`), Redis connections (:mod:`.redisconn`), credential
encryption (:mod:`.crypto`), redaction (:mod:`.redact`), the egress guard (:mod:`.egress`), backoff
curves (:mod:`.backoff`), hot-path counters in Redis (:mod:`.counters`), schedule URL schemes
(:mod:`.schedule_urls`) and the deployment files the wheel ships (:mod:`.deployment`)."""
