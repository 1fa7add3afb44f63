"""The colocated server: the public Generate API served by one pod that runs prefill and decode itself
(no router, no KV handoff). The baseline the split system is measured against."""
