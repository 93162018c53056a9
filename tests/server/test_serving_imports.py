"""What a serving gateway loads: the libraries only other commands need stay out of its memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# redis-py is ~22 MiB resident, numpy ~15 MiB, obstore ~4 MiB: a gateway on its embedded store and local disk,
# scoring through the classifier's C table, needs none (issue 36's RSS target is 120 MiB after a benchmark run).
NOT_FOR_SERVING = ("redis", "numpy", "sklearn", "scipy", "obstore")


def test_a_gateway_serving_on_its_embedded_store_loads_no_library_it_does_not_use() -> None:
    policy = Path(__file__).parents[2] / "policies" / "default.yaml"
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        from gateway.cli.command import build_parser
        from gateway.server.app import create_app
        from gateway.server.settings import Settings

        build_parser()  # `serve` parses the whole CLI first: every command's module is imported
        async def main():
            app = create_app(Settings(policy={str(policy)!r}))
            from aiohttp import web
            runner = web.AppRunner(app)
            await runner.setup()  # the stores open, the classifier loads
            await runner.cleanup()
        asyncio.run(main())
        print(json.dumps(sorted(m for m in {NOT_FOR_SERVING!r} if m in sys.modules)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
