"""PostgreSQL storage: SQLAlchemy 2 models (:mod:`.models`), engines and sessions (:mod:`.session`),
Alembic migrations (:mod:`.migrate`, ``migrations/``) and the import/read repository (:mod:`.repo`).
"""

from magpie.db.session import dispose_engines, get_engine, session_scope

__all__ = ["dispose_engines", "get_engine", "session_scope"]
