"""Numbers as people read them in logs and plans."""

from __future__ import annotations

GiB = 2**30


def human_count(n: float) -> str:
    """999 -> '999', 12_345 -> '12.3 K', 593_000 -> '0.6 M', 134_515_008 -> '135 M', 7.6e9 -> '7.6 B'."""
    for threshold, scale, unit in ((1e9, 1e9, "B"), (1e5, 1e6, "M"), (1e3, 1e3, "K")):
        if n >= threshold:
            value = n / scale
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    """Bytes in binary units, as `du -h` counts them: 1.61e9 -> '1.50 GiB', 3_500_000 -> '3.3 MiB', 0 -> '0 KiB'."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 1024:.0f} KiB"
