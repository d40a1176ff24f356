"""`python -m agentgrove.cli`."""

from agentgrove.cli.main import main

main()
