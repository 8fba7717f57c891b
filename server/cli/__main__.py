"""`python -m flashserve.server.cli`: the same as the `flashserve` command."""

from flashserve.server.cli.main import run

run()
