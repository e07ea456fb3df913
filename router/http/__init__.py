"""The router's lean HTTP/1.1 server and upstream client (see server.py for why)."""
