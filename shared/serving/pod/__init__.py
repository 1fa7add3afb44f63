"""One pod: its runtime (model, engine thread, admission), its gRPC servicer base and call lifecycle, the
named errors and their one status table, its flags, and serving it until stopped."""
