"""Reproducible benchmarks, installed as ``ivyplug.benchmarks`` and run by ``ivyplug bench NAME``."""
