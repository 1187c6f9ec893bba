"""The boundary between the HTTP front ends and the engine core: the messages they exchange (messages.py),
the engine core's side (core_server.py) and the front end's engine client (core_client.py)."""
