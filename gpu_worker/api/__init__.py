"""The worker's network edge: `hybridserve worker` (server.py), the Generation servicer and its wire
conversion, the health probes and drain, and the Generation API's client side (client.py), which the
gateway and the command line use."""
