"""`python -m gateway` is the agent-gateway CLI."""

import sys

from gateway.cli.command import main

sys.exit(main())
