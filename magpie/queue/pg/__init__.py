"""The route schedule in PostgreSQL: one table claimed with ``FOR UPDATE SKIP LOCKED`` (see
:mod:`magpie.queue.pg.schedule`); chosen by a ``postgresql://`` ``MAGPIE_SCHEDULE_URL``."""

from magpie.queue.pg.schedule import PgSchedule

__all__ = ["PgSchedule"]
