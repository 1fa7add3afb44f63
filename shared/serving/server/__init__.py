"""What every server of the serving floor runs on: the gRPC server (health, reflection, shutdown) and the
HTTP server, the serve-until-stopped loop and the drain, TLS, the API token and the KV-handle key, tracing,
Prometheus metrics, settings (flags generated from config fields) and the CPU quota."""
