"""Coordination between processes and instances: renewable leader locks (:mod:`.leader`), fencing tokens
(:mod:`.fencing`), the instance registry (:mod:`.instances`), quiet housekeeping triggers (:mod:`.ticks`),
and the shared rate limits (:mod:`.throttle`, :mod:`.ratelimit`)."""
