"""The check pipeline: promote claims due routes and dispatches check messages (:mod:`.promote`); a
check-worker process's pool runs their leases and completes them (:mod:`.checkpool`), a quarantined
check in a process of its own (:mod:`.isolation`)."""
