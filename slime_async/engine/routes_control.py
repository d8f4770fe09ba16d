"""The embedded engine's control-plane routes, with SGLang's paths, bodies and status codes:
generation control (`/pause_generation`, `/continue_generation`, `/abort_request`,
`/flush_cache`), weight updates (`/update_weights_from_disk`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, `/update_weight_version`,
the refused `/update_weights_from_tensor`), LoRA adapters (`/load_lora_adapter`,
`/unload_lora_adapter`, the refused `/load_lora_adapter_from_tensors`) and sleep / wake
(`/release_memory_occupation`, `/resume_memory_occupation`: `engine/sleep.py`).

Owns: `add_control_routes(app)`, the handlers and their body parsing: every field is checked
here and a bad one answers 400 naming it before the engine is called (a bucket call refused
this way answers `received: false`); the work is `Engine.weights` / `Engine.weight_groups`.
Must never import torch model code.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.weight_buckets import FLATTENED, entries_from_body
from slime_async.engine.engine import Engine
from slime_async.engine.http_common import engine_of, error, json_body
from slime_async.engine.sampling import RequestError
from slime_async.engine.sleep import parse_tags


def add_control_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/load_lora_adapter", load_lora_adapter)
    r.add_post("/unload_lora_adapter", unload_lora_adapter)
    r.add_post("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors)
    r.add_route("*", "/release_memory_occupation", release_memory_occupation)
    r.add_route("*", "/resume_memory_occupation", resume_memory_occupation)


# ---------------------------------------------------------------------------- generation
async def pause_generation(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        mode = eng.pause_mode(body.get("mode", "abort"))
    except (RequestError, ValueError) as e:
        return error(str(e))
    await eng.pause(mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    engine_of(request).resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
    except RequestError as e:
        return error(str(e))
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
        return error("abort_request takes {rid: str} or {abort_all: true}")
    if rid is None and not abort_all:
        return error("abort_request needs `rid` or `abort_all: true`")
    eng.abort(rid=rid, abort_all=abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    if engine_of(request).flush_cache():
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")
    return web.Response(status=400, text="Cache not flushed: requests are running; retry later.")


# ---------------------------------------------------------------------------- weights
def _bool_field(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false")
    return v


def _version_field(body: dict[str, Any]) -> str | None:
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str | int):
        raise RequestError("weight_version must be a string")
    return None if version is None else str(version)


def _update_reply(res: Any) -> web.Response:
    body = {
        "success": res.success,
        "message": res.message,
        "num_paused_requests": res.num_paused_requests,
    }
    if res.received is not None:
        body["received"] = res.received
    if getattr(res, "group_broken", False):
        body["group_broken"] = True
    return web.json_response(body, status=200 if res.success else 400)


def _result_reply(res: Any) -> web.Response:
    """SGLang's plain answer of a group route: success and message, 400 on failure."""
    return web.json_response(
        {"success": res.success, "message": res.message}, status=200 if res.success else 400
    )


def _refuse(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=400)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("update_weights_from_disk needs `model_path` (a directory)")
        version = _version_field(body)
        abort_all = _bool_field(body, "abort_all_requests", False)
        flush = _bool_field(body, "flush_cache", True)
        if why := eng.memory.refuse_update("update_weights_from_disk"):
            raise RequestError(why)
    except RequestError as e:
        return _refuse(str(e))
    res = await eng.weights.update_weights_from_disk(
        path, weight_version=version, abort_all_requests=abort_all, flush_cache=flush
    )
    return _update_reply(res)


async def init_weights_update_group(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        addr, port = body.get("master_address"), body.get("master_port")
        offset, size = body.get("rank_offset"), body.get("world_size")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if not isinstance(addr, str) or not addr:
            raise RequestError("init_weights_update_group needs `master_address` (rank 0's IP)")
        for key, v in (("master_port", port), ("rank_offset", offset), ("world_size", size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RequestError(f"init_weights_update_group needs `{key}` (an integer >= 0)")
        if not 0 < offset < size:
            raise RequestError(
                f"rank_offset {offset} must be in 1..world_size-1 ({size}): rank 0 is the sender"
            )
        if not isinstance(name, str) or not name:
            raise RequestError("group_name must be a non-empty string")
        if backend != "gloo":
            raise RequestError(
                f"backend {backend!r}: the embedded engine serves from CPU memory and joins weight "
                "groups over gloo; send backend 'gloo' (NCCL is for SGLang engines on GPUs)"
            )
    except RequestError as e:
        return _refuse(str(e))
    res = await eng.weight_groups.init_weights_update_group(
        master_address=addr,
        master_port=port,
        rank_offset=offset,
        world_size=size,
        group_name=name,
        backend=backend,
    )
    return _result_reply(res)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=False)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
    except RequestError as e:
        return _refuse(str(e))
    res = eng.weight_groups.destroy_weights_update_group(name)
    return _result_reply(res)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        try:
            entries = entries_from_body(body.get("names"), body.get("dtypes"), body.get("shapes"))
        except ValueError as e:
            raise RequestError(f"update_weights_from_distributed: {e}") from None
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
        fmt = body.get("load_format")
        if fmt not in (None, FLATTENED):
            raise RequestError(f"load_format must be null or {FLATTENED!r}, got {fmt!r}")
        if fmt == FLATTENED and len({e.dtype for e in entries}) != 1:
            raise RequestError(f"a {FLATTENED} bucket must hold tensors of one dtype")
        selector = body.get("selector", "target")
        if selector not in ("target", "all"):
            raise RequestError(f"selector {selector!r}: this engine has no draft model")
        version = _version_field(body)
        abort_all = _bool_field(body, "abort_all_requests", False)
        flush = _bool_field(body, "flush_cache", True)
        lora_name, lora_spec = _adapter_fields(body)
        segment = body.get("shm_segment")
        if segment is not None and not isinstance(segment, str):
            raise RequestError("shm_segment must be a string (a weight-group segment name)")
        if why := eng.memory.refuse_update("update_weights_from_distributed"):
            raise RequestError(why)
    except RequestError as e:
        # refused before receiving: the sender must abort the group (docs/weight-sync.md)
        return _refuse(str(e), received=False)
    res = await eng.weight_groups.update_weights_from_distributed(
        entries,
        group_name=name,
        load_format=fmt,
        weight_version=version,
        abort_all_requests=abort_all,
        flush_cache=flush,
        lora_name=lora_name,
        lora_spec=lora_spec,
        shm_segment=segment,
    )
    return _update_reply(res)


def _adapter_fields(body: dict[str, Any]) -> tuple[str | None, LoraSpec | None]:
    """Our extension of `/update_weights_from_distributed`: `lora_name` + `lora_config` (the
    adapter's `adapter_config.json` as a JSON object) say the bucket holds that adapter's
    tensors in PEFT's names (docs/lora.md); both absent: model weights, as in SGLang."""
    name, cfg = body.get("lora_name"), body.get("lora_config")
    if name is None and cfg is None:
        return None, None
    if not isinstance(name, str) or not name or not isinstance(cfg, dict):
        raise RequestError(
            "adapter buckets need `lora_name` (a non-empty string) and `lora_config` (the "
            "adapter_config.json object) together"
        )
    try:
        return name, LoraSpec.from_peft_config(cfg)
    except ValueError as e:
        raise RequestError(f"lora_config: {e}") from None


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's payload is pickled (MultiprocessingSerializer; CUDA IPC handles between
    colocated processes). Network data is never unpickled here: refuse, naming the alternatives."""
    return _refuse(
        "update_weights_from_tensor carries pickled tensors (SGLang's MultiprocessingSerializer, "
        "CUDA IPC handles for a colocated trainer); this engine never unpickles request data. "
        "Use update_weights_from_distributed (a weight update group) or update_weights_from_disk."
    )


async def update_weight_version(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        new = body.get("new_version")
        if new is None or not isinstance(new, str | int):
            raise RequestError("update_weight_version needs `new_version` (a string)")
        abort_all = body.get("abort_all_requests", True)
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all_requests must be true or false")
    except RequestError as e:
        return web.json_response({"success": False, "message": str(e)}, status=400)
    res = await eng.weights.update_weight_version(str(new), abort_all_requests=abort_all)
    return web.json_response(
        {"success": res.success, "message": res.message, "new_version": str(new)}
    )


async def _memory_tags(request: web.Request) -> list[str] | None:
    """The body's tags; None when it names none (SGLang: all of them)."""
    raw = (await json_body(request, required=False)).get("tags")
    return None if raw is None or raw == [] else parse_tags(raw)


async def release_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's sleep: `{tags}` (null: all). 200 with a null body; an engine that is not idle,
    or a bad tag, is answered 400 with SGLang's error body (engine/sleep.py)."""
    eng = engine_of(request)
    try:
        await eng.memory.release(await _memory_tags(request) or parse_tags(None))
    except ValueError as e:  # RequestError included
        return error(str(e))
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's wake: `{tags}`; a tag that is not released is refused (400). Null wakes
    whatever is released (SGLang would refuse null after a partial release)."""
    eng = engine_of(request)
    try:
        tags = await _memory_tags(request)
        await eng.memory.resume(sorted(eng.memory.released) if tags is None else tags)
    except ValueError as e:
        return error(str(e))
    return web.json_response(None)


# ---------------------------------------------------------------------------- LoRA adapters
def _lora_reply(eng: Engine, res: Any) -> web.Response:
    """SGLang's `LoRAUpdateResult`: success, error_message, loaded_adapters (400 on failure)."""
    lora = eng.lm.lora if eng.lm is not None else None
    body = {
        "success": res.success,
        "error_message": None if res.success else res.message,
        "loaded_adapters": lora.loaded() if lora is not None else {},
    }
    return web.json_response(body, status=200 if res.success else 400)


def _name_field(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise RequestError(f"{key} must be a non-empty string")
    return v


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`{lora_name, lora_path[, pinned][, weight_version]}`: a PEFT directory (safetensors only)
    staged and checked before it serves; `weight_version` replaces a loaded adapter of that
    name in place (a versioned push). Our extension `{lora_name, weight_version,
    from_distributed: true}` (no `lora_path`) activates the adapter of that version received
    over a weight group (`/update_weights_from_distributed` with `lora_name`)."""
    eng = engine_of(request)
    try:
        body = await json_body(request, required=True)
        name = _name_field(body, "lora_name")
        received = _bool_field(body, "from_distributed", False)
        path = None if received else _name_field(body, "lora_path")
        if received and body.get("lora_path") is not None:
            raise RequestError("from_distributed takes no lora_path: send one or the other")
        _bool_field(body, "pinned", False)  # SGLang's: nothing is evicted here
        version = _version_field(body)
        if received and version is None:
            raise RequestError("from_distributed needs the weight_version that was received")
        if why := eng.memory.refuse_update("load_lora_adapter"):
            raise RequestError(why)
    except RequestError as e:
        return error(str(e))
    res = await eng.weights.load_lora_adapter(
        name, path, weight_version=version, from_distributed=received
    )
    return _lora_reply(eng, res)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        name = _name_field(await json_body(request, required=True), "lora_name")
    except RequestError as e:
        return error(str(e))
    return _lora_reply(eng, await eng.weights.unload_lora_adapter(name))


async def load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    """SGLang's payload is pickled (the unauthenticated-RCE route of CVE-2026-15969): refused."""
    return error(
        "load_lora_adapter_from_tensors carries pickled tensors; this engine never unpickles "
        "request data. Write a PEFT directory and use /load_lora_adapter."
    )
