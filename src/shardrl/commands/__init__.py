"""Command implementations behind the CLI (imported after argument parsing)."""
