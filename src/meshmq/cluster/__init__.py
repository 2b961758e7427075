"""The mesh: routers linked to each other, one per worker process (and later per host)."""
