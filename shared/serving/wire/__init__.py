"""What crosses between services: the proto-free payloads (payloads.py) and the only proto <-> domain
mapping, one module per proto file (common, prefill, decode, generate, kv_events)."""
