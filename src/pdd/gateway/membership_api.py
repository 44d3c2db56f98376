"""The gateway's operator endpoints of the elastic topology (``pdd.gateway.membership``), behind
the API keys like every other endpoint (docs/SECURITY.md):

- ``GET /pdd/instances``: every slot with its role, address, state, in-flight count, routed count.
- ``POST /pdd/instances`` ``{"role", "name"?, "address"?, "start"?}``: add one.
- ``POST /pdd/instances/{name}/drain`` ``{"force"?, "remove_when_idle"?}``: stop routing to it.
- ``DELETE /pdd/instances/{name}`` (``?force=true``): remove it (``force``: ``true`` / ``1`` or
  ``false`` / ``0``; anything else, or ``force`` given twice, is a 400 ``invalid_query``, :func:`query_flag`).
- ``POST /pdd/instances/{name}/role`` ``{"role", "force"?}``: re-role a relay decoder the config's
  ``rerole`` lists to main-decode duty in datacenter A (``main_decode``) or back
  (``relay_decode``); answers once it serves in the new role (it is drained first).

Refusals are OpenAI-style error bodies: 400 (bad body, unknown role, bad address), 403 (re-role
not allowed by the config), 404 (no such instance), 409 (duplicate, still in flight, last active
of its role, another instance answering at the slot's address), 503 (unreachable). Booleans are strict: ``"yes"`` or ``1`` is a 400 naming the field.
"""

from __future__ import annotations

import codecs
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from pdd.gateway.membership import Membership, MembershipError
from pdd.gateway.openai_schemas import error_body, media_type, not_utf8, too_deep, too_many_digits
from pdd.text import shown


class AddInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    name: Optional[str] = None
    address: Optional[str] = None
    start: StrictBool = False


class DrainInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    force: StrictBool = False
    remove_when_idle: StrictBool = False


class RoleChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    force: StrictBool = False


def _error(e: MembershipError) -> JSONResponse:
    etype = "invalid_request_error" if e.status < 500 else "server_error"
    return JSONResponse(error_body(e.message, e.param, e.code, etype=etype), status_code=e.status)


async def _body(request: Request, model):
    """The request's JSON body as ``model`` (an empty body: all defaults). Raises MembershipError:
    415 for a body sent with a content type other than JSON (as the /v1 endpoints answer), 400
    naming the field for a bad one, 400 for one that is not UTF-8 (``not_utf8``), nested too deeply
    (``too_deep``) or with an integer past Python's digit limit (``too_many_digits``)."""
    raw = await request.body()
    ctype = media_type(request.headers.get("content-type"))
    if raw.strip() and ctype and "json" not in ctype:
        raise MembershipError(415, f"Unsupported Media Type: the request body must be JSON sent with "
                                   f"Content-Type: application/json (got {ctype!r})", None, "unsupported_media_type")
    why = not_utf8(raw) or too_deep(raw)  # as the /v1 endpoints say it (pydantic's parser: "expected value at line 1 column 1")
    if why is not None:
        raise MembershipError(400, why, None, "invalid_body")
    try:  # a UTF-8 byte-order mark is ignored, as on /v1 (pydantic's parser refuses one)
        return model.model_validate_json(raw.removeprefix(codecs.BOM_UTF8) or b"{}")
    except ValidationError as ex:
        err = ex.errors()[0]
        why = too_many_digits(raw) if err.get("type") == "json_invalid" else None  # "number out of range"
        if why is not None:
            raise MembershipError(400, why, None, "invalid_body") from None
        where = ".".join(str(x) for x in err.get("loc", ())) or None
        raise MembershipError(400, f"{where or 'body'}: {err.get('msg')}", where, "invalid_body") from None


QUERY_TRUE, QUERY_FALSE = ("1", "true"), ("0", "false")


def query_flag(request: Request, field: str) -> bool:
    """The boolean query flag ``field`` of ``request`` (``?force=1``): ``1`` or ``true`` is True,
    ``0`` or ``false`` (or no such flag) False. Raises MembershipError(400, ``invalid_query``,
    naming ``field``) for any other value (``yes``, ``TRUE``, empty), as the operator bodies'
    booleans are strict, and for a flag given more than once (``?force=maybe&force=0``: which
    one the operator meant is not for the gateway to guess)."""
    given = request.query_params.getlist(field)
    if len(given) > 1:
        vals = ", ".join(shown(v) for v in given[:4]) + (f", ... ({len(given)} values)" if len(given) > 4 else "")
        raise MembershipError(400, f"{field}: given more than once ({vals}); give it once", field, "invalid_query")
    raw = given[0] if given else None
    if raw is None or raw in QUERY_FALSE:
        return False
    if raw in QUERY_TRUE:
        return True
    raise MembershipError(400, f"{field}: must be true or false (or 1 or 0), got {shown(raw)}", field,
                          "invalid_query")


def add_membership_routes(app: FastAPI, ms: Membership) -> None:
    @app.get("/pdd/instances")
    async def list_instances():
        return ms.listing()

    @app.post("/pdd/instances")
    async def add_instance(request: Request):
        try:
            b = await _body(request, AddInstance)
            return await ms.add(b.role, b.name, b.address, b.start)
        except MembershipError as e:
            return _error(e)

    @app.post("/pdd/instances/{name}/drain")
    async def drain_instance(name: str, request: Request):
        try:
            b = await _body(request, DrainInstance)
            return await ms.drain(name, force=b.force, remove_when_idle=b.remove_when_idle)
        except MembershipError as e:
            return _error(e)

    @app.post("/pdd/instances/{name}/role")
    async def rerole_instance(name: str, request: Request):
        try:
            b = await _body(request, RoleChange)
            return await ms.rerole(name, b.role, force=b.force)
        except MembershipError as e:
            return _error(e)

    @app.delete("/pdd/instances/{name}")
    async def remove_instance(name: str, request: Request):
        try:
            return await ms.remove(name, force=query_flag(request, "force"))
        except MembershipError as e:
            return _error(e)
