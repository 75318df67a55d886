"""A device probe that reads the 1-minute OS load average, shipped as an ivyplug plugin."""
