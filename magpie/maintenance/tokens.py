"""Job ``token_expiry``: delete dead password-reset tokens and invitations.

Kept for ``MAGPIE_TOKEN_RETENTION_DAYS`` after they stop being usable (so "this link expired" can still
be told apart from "no such link"), then deleted in batches:

* ``password_reset_tokens``: expired, or used.
* ``invitations``: never accepted and expired or revoked. Accepted invitations are kept (they record who
  joined a workspace, and when).

A table that does not exist is skipped.
"""

from __future__ import annotations

from datetime import timedelta

from magpie.maintenance.base import Job, JobContext, batched_delete, table_exists

_TOKENS = """
    DELETE FROM password_reset_tokens WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM password_reset_tokens
        WHERE expires_at < :cutoff OR used_at < :cutoff
        LIMIT :batch))
"""
_INVITATIONS = """
    DELETE FROM invitations WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM invitations
        WHERE accepted_at IS NULL AND (expires_at < :cutoff OR revoked_at < :cutoff)
        LIMIT :batch))
"""


class TokenExpiryJob(Job):
    name = "token_expiry"
    every = 3600.0
    description = "delete expired/used password-reset tokens and dead (unaccepted) invitations"

    def run(self, ctx: JobContext) -> dict:
        cutoff = ctx.now - timedelta(days=int(ctx.settings.token_retention_days))
        out: dict = {"cutoff": cutoff.isoformat(), "complete": True}
        for key, table, sql in (
            ("reset_tokens_deleted", "password_reset_tokens", _TOKENS),
            ("invitations_deleted", "invitations", _INVITATIONS),
        ):
            with ctx.engine.connect() as conn:
                if not table_exists(conn, table):
                    out[key] = None
                    continue
            n, complete = batched_delete(ctx, sql, {"cutoff": cutoff})
            out[key] = n
            if not complete:
                out["complete"] = False
                break
        return out


JOB = TokenExpiryJob()
