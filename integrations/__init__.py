"""Framework adapters, installed as ``ivyplug.integrations``: they import the core, never the reverse."""
