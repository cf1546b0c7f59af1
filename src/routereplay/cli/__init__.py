"""The `routereplay` command line: one subcommand per module, dispatched by `main`."""
