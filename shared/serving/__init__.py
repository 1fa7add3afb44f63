"""The serving floor: one pod around the engine, gRPC server plumbing, proto mapping, telemetry, metrics."""
