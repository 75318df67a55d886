"""The wire: message headers, channels over gloo, payload segments and codecs, shared memory, auth.

Everything a worker and a server exchange, and how: nothing here knows what a shard or a client is
(it imports no other part of ``ivyplug.ps`` but the shard plan).
"""
