"""The broker's I/O: sockets, TLS, WebSocket and the asyncio protocol of each MQTT connection.

Everything here is asyncio glue between a socket and the core (the rest of ``broker/``): it
feeds bytes to the sans-I/O ``ServerConnection`` (mqtt/) and the decoded packets to the
``Broker``. The core never imports this package: it sees a connection only as the
``ClientHandle`` it defines (broker/client.py).
"""
