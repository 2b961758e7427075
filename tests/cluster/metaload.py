"""The register workload (metacheck.py) as a process of its own, for voters in network
namespaces: an abstract unix socket belongs to its namespace, so the client must run there.

    python metaload.py SOCKET CLIENT STOP_FILE    run the loop until STOP_FILE exists,
                                                   printing each operation as a JSON line
    python metaload.py SOCKET --final             print the register as {"version", "value"}
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from metacheck import Op, client_loop, final_register

from meshmq.cluster.metaclient import MetaClient


class Printed(list[Op]):
    """A history that prints each operation as it is recorded (the test reads them live)."""

    def append(self, op: Op) -> None:
        super().append(op)
        print(json.dumps(op.to_json()), flush=True)


async def run(socket: str, client_name: str, stop_file: Path) -> None:
    client = MetaClient(socket)
    await client.connect()
    try:
        await client_loop(client, client_name, Printed(), stop_file.exists)
    finally:
        await client.close()


async def final(socket: str) -> None:
    client = MetaClient(socket)
    await client.connect()
    try:
        version, value = await final_register(client)
    finally:
        await client.close()
    print(json.dumps({"version": version, "value": value}))


def main() -> None:
    if sys.argv[2] == "--final":
        asyncio.run(final(sys.argv[1]))
    else:
        asyncio.run(run(sys.argv[1], sys.argv[2], Path(sys.argv[3])))


if __name__ == "__main__":
    main()
