"""Benchmark harness: wrenmq vs Mosquitto, driven by the mqload load generator.

Run it as ``python -m wrenmq.bench`` (``make bench`` / ``make bench-quick``);
``python -m wrenmq.bench --help`` lists the options. Standard library only.
"""
