"""The AgentGrove benchmark: raw nats-py baselines, then the control plane measured against them.

Run it with `make bench` or `python -m bench` (`--quick` for small counts).
"""
