"""Rank 0's side of the server: what every process of `launch/serve.py` does at start-up and
clean-up (`main`), the engine loop that takes requests from the API process over ZeroMQ and runs
one engine step at a time (`engine_loop`), the admin operations it runs between steps
(`control_ops`), its watchdog, and the data-parallel launcher (`replicas`, `router_process`)."""
