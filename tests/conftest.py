"""The suite's fixtures live in tests/fixtures/; this file only registers them."""

pytest_plugins = [
    "tests.fixtures.stack",
    "tests.fixtures.redis_server",
    "tests.fixtures.s3_server",
    "tests.fixtures.vllm_pair",
]
