"""GET /health, /info and /metrics: the state of the server, its model, its cache and its engine."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fp8cache.server.metrics import CONTENT_TYPE
from fp8cache.server.protocol.base import MAX_STOP_SEQUENCES
from fp8cache.server.state import AppState, app_state
from fp8cache.version import __version__


async def health(request: Request) -> Response:
    state = app_state(request)
    if not state.engine.alive:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    stalled = state.engine.stalled_seconds()
    if stalled > state.settings.stall_timeout:
        return JSONResponse({"status": f"engine stalled: requests are waiting and no engine step has finished for "
                                       f"{stalled:.0f} s (fp8kv run --stall-timeout {state.settings.stall_timeout:g})"},
                            status_code=503)
    return JSONResponse({"status": "ok"})


def engine_snapshot(state: AppState) -> dict[str, Any]:
    stats = state.engine.stats()
    state.metrics.observe_engine(stats)
    return stats


async def info(request: Request) -> Response:
    state = app_state(request)
    i, stats = state.info, engine_snapshot(state)
    return JSONResponse({
        "model_id": state.settings.served_model_name, "model_sha": None, "model_dtype": i.model_dtype,
        "model_device_type": i.device, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": state.settings.max_concurrent_requests, "max_best_of": 1,
        "max_stop_sequences": MAX_STOP_SEQUENCES, "max_input_tokens": i.max_model_len - 1,
        "max_input_length": i.max_model_len - 1, "max_total_tokens": i.max_model_len,
        "validation_workers": 1, "max_client_batch_size": 1, "router": "fp8kv", "version": __version__,
        "sha": None, "docker_label": None,
        "kv_cache": {"dtype": i.kv_cache_dtype, "scales_source": i.scales_source, "block_size": i.block_size,
                     "num_blocks": i.num_blocks, "capacity_tokens": i.capacity_tokens,
                     "recent_window": i.kv_recent_window,
                     "recent_window_sinks": i.kv_recent_window_sinks, "recent_window_dtype": i.window_dtype,
                     "scales": i.kv_scales, "rotation": i.kv_rotation, "skip_layers": list(i.skip_layers),
                     "blocks_used": stats.get("blocks_used"), "blocks_free": stats.get("blocks_free")},
        "engine": stats,
    })


async def metrics(request: Request) -> Response:
    state = app_state(request)
    engine_snapshot(state)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
