"""The front's handle on engines: the engine client interface (`engine_client`) and its ways of
reaching an engine (a worker process over ZMQ, watched and restarted; an engine on a thread of
this process), the worker processes and their sockets, data parallelism and its router,
headless nodes. Nothing here imports the engine's code (`nanoserve.core`)."""
