"""The resource-governor: admits, queues or rejects spawns under limits."""
