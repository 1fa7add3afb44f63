"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models and
vLLM's /tokenize, over the router's or the colocated pod's domain generate()."""
