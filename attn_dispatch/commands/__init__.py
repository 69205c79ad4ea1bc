"""CLI subcommands, one module each (see attn_dispatch.cli.COMMANDS)."""
