"""The server side: shards, the loop that serves them, the batch queue, ``ivyplug serve``.

A shard (shard.py) owns its state and its lock; endpoints.py is how anyone (a worker, another shard)
reaches one; loop.py decodes requests off the wire into shard calls. Never imports the worker side.
"""
