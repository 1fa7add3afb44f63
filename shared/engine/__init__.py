"""The engine floor: request, scheduler, paged KV cache, KV transfer, model and LLMEngine.

Nothing here imports grpc, proto or OpenTelemetry (tests/test_import_boundaries.py checks it)."""
