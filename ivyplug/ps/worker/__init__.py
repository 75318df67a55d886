"""The worker side: ``PSClient`` and how it reaches the shards (topology, layout, early pushes, groups)."""
