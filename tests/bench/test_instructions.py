"""The instruction-count benchmark counts a real proxy's requests under callgrind."""

from __future__ import annotations

from pathlib import Path

from bench import instructions
from bench.proxy_bench import PY, free_port, start, wait_ready


def test_it_counts_the_minimal_proxys_instructions_per_request(tmp_path: Path) -> None:
    up_port = free_port()
    upstream = start([PY, "-m", "fakes.openai_upstream", str(up_port)])
    try:
        wait_ready(up_port)
        port = free_port()
        per_request = instructions.count(
            "minimal proxy", [PY, "-m", "bench.minimal_proxy", str(port), f"http://127.0.0.1:{up_port}"], port, {},
            requests=20, warmup=5, concurrency=2, out_dir=tmp_path / "dumps")
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    # ~590k on this machine at c=8; a figure off by orders of magnitude is a dump misread (the startup's
    # hundreds of millions, or a part of the counters)
    assert 100_000 < per_request < 5_000_000
    assert list((tmp_path / "dumps").glob("callgrind.out.*"))


def test_a_dump_is_read_from_its_summary_line(tmp_path: Path) -> None:
    (tmp_path / "callgrind.out.1").write_text("events: Ir\n")
    (tmp_path / "callgrind.out.1.1").write_text("version: 1\nevents: Ir\nsummary: 123456\nfn=x\n0 1\n")
    assert instructions._dumped_instructions(tmp_path, {tmp_path / "callgrind.out.1"}) == 123456
