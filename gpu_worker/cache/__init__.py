"""Prefix caching on the worker: block identity, the local tier, checkpoint (de)serialisation and
the client of the shared tier (cache_svc)."""
