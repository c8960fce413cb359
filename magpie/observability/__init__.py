"""What an operator watches: the Prometheus exporter (:mod:`.metrics`), health checks and probes
(:mod:`.health`, :mod:`.probes`), the dashboard's throughput samples (:mod:`.samples`), the JSON log
format (:mod:`.logs`) and Flower's safe defaults (:mod:`.flower`)."""
