"""meshmq's asyncio client: an MQTT 5 connection kept up across a list of brokers, and the
services on top of it (docs/services.md).

::

    from meshmq.client import Client, ServiceWorker

    async with Client(["127.0.0.1:1883"]) as client:
        reply = await client.call("billing", b"invoice 7", timeout=10)

    async def handle(request):
        return b"paid " + request.payload

    async with Client(["127.0.0.1:1883"], "billing-1") as client:
        await ServiceWorker(client, "billing", handle, credit=4).run()
"""

from meshmq.client.calls import CallTimeout, Reply, ServiceError
from meshmq.client.client import Client, ConnectFailed, parse_brokers
from meshmq.client.worker import Request, ServiceWorker

__all__ = ["CallTimeout", "Client", "ConnectFailed", "Reply", "Request", "ServiceError",
           "ServiceWorker", "parse_brokers"]
