"""A request as both sides of the engine see it, and what the HTTP front end needs of an engine.

What a request asks for (sampling_params.py) and gets back (outputs.py); how its token ids become text with
stop strings (detokenizer.py) and reach the handler waiting for them (output_collector.py); the interface the
HTTP layer calls, with its errors and statistics (client.py); the typed commands an engine takes (commands.py).
The front ends (entrypoints/, ipc/core_client.py) and the engine core (engine/, ipc/core_server.py) both import
this package; it imports neither, and nothing heavier than msgspec, so a front end process loads it without
torch.
"""
