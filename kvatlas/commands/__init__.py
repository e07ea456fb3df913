"""One module per top-level CLI command. Each module defines ``register(subparsers)``; the CLI
discovers them, so adding a command never means editing a shared list."""
