"""The spawner: runs admitted agents on their runtimes and reports their lifecycle."""
