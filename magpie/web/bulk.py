"""The dashboard's bulk operator verbs (``/api/bulk/...``), the same as ``magpie workspaces`` and
``magpie bulk`` (:mod:`magpie.admin.operations`). Every operation needs the action token
(``Authorization: Bearer <MAGPIE_WEB_TOKEN>``); ``dry_run`` counts without changing anything. An unknown
workspace answers 404, an existing one or a removal without any filter 409, both as
``{"ok": false, "refused": "<code>", "detail": ...}`` (codes of :class:`magpie.admin.operations.OperationError`).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from magpie.base.protocols import ProtocolName
from magpie.web.api import REFUSALS, UNAVAILABLE, Dash, action_token

router = APIRouter(prefix="/api/bulk", responses={**UNAVAILABLE, **REFUSALS,
                                                  400: {"description": "The body is not JSON"},
                                                  404: {"description": "No such workspace"}},
                   dependencies=[Depends(action_token)], tags=["bulk"])

class BulkDone(BaseModel):
    ok: Literal[True] = True
    result: dict | list


class Strict(BaseModel):
    """Request bodies: no type coercion (``0`` is not ``false``), no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class WorkspaceName(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    dry_run: bool = False


class RemoveRoutes(Strict):
    workspace: str | None = Field(None, max_length=64)
    protocol: ProtocolName | None = None
    dead_days: float | None = Field(None, ge=0, le=36500)
    dry_run: bool = False


class ReprocessDead(Strict):
    reason: str | None = Field(None, max_length=64)
    older_than_s: float | None = Field(None, ge=0)
    dry_run: bool = False


class RetryDeliveries(Strict):
    kind: Literal["webhook", "email"] = "webhook"
    channel_id: int | None = None
    dry_run: bool = False


def _run(call):
    from magpie.admin.operations import OperationError

    try:
        return {"ok": True, "result": call()}
    except OperationError as exc:
        return JSONResponse({"ok": False, "refused": exc.code, "detail": str(exc), "member": None},
                            status_code=404 if exc.code == "unknown_workspace" else 409)


@router.get("/workspaces", response_model=BulkDone, summary="Workspaces with their route counts")
def api_workspaces_list(d: Dash):
    from magpie.admin.operations import list_workspaces

    return {"ok": True, "result": list_workspaces(d.engine)}


@router.post("/workspaces/create", response_model=BulkDone, summary="Create a workspace")
def api_workspace_create(body: WorkspaceName, d: Dash):
    from magpie.admin.operations import create_workspace

    return _run(lambda: create_workspace(d.engine, body.name, dry_run=body.dry_run))


@router.post("/workspaces/delete", response_model=BulkDone,
             summary="Delete a workspace; its routes leave it through fenced calls")
def api_workspace_delete(body: WorkspaceName, d: Dash):
    from magpie.admin.operations import delete_workspace

    return _run(lambda: delete_workspace(d.engine, d.queue, body.name, dry_run=body.dry_run))


@router.post("/remove-routes", response_model=BulkDone, summary="Remove routes by workspace, protocol, dead days")
def api_remove_routes(body: RemoveRoutes, d: Dash):
    from magpie.admin.operations import remove_routes

    return _run(lambda: remove_routes(d.engine, d.queue, workspace=body.workspace, protocol=body.protocol,
                                      dead_days=body.dead_days, dry_run=body.dry_run))


@router.post("/reprocess-dead", response_model=BulkDone, summary="Put dead letters back (all, or filtered)")
def api_reprocess_dead(body: ReprocessDead, d: Dash):
    from magpie.admin.operations import reprocess_dead

    return _run(lambda: reprocess_dead(d.queue, reason=body.reason, older_than_s=body.older_than_s,
                                       dry_run=body.dry_run))


@router.post("/retry-deliveries", response_model=BulkDone, summary="Retry every failed delivery")
def api_retry_deliveries(body: RetryDeliveries, d: Dash):
    from magpie.admin.operations import retry_failed

    return _run(lambda: retry_failed(d.engine, kind=body.kind, channel_id=body.channel_id, dry_run=body.dry_run))


__all__ = ["router"]
