"""Former home of the schedule interface; see :mod:`magpie.queue.provider`."""

from magpie.queue.provider import QueueBackend, ScheduleProvider, create_provider

__all__ = ["QueueBackend", "ScheduleProvider", "create_provider"]
