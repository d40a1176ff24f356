"""The router: the agent tree, subscriptions, inbox delivery and HITL routing."""
