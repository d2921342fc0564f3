"""Prometheus metrics: `definitions` declares every instrument, `serving` exposes them."""
