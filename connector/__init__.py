"""KV data plane: NIXL agents, the lease/transfer protocol, and engine connectors."""
