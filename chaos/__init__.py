"""Chaos runs of the whole stack: agent trees while services and nats-server are killed."""
