"""The last import of the fork server that CPU test ranks are forked from (tests/ranks.py): what the server has
imported goes to the cyclic collector's permanent generation, which each forked rank inherits. An engine rank then
walks only what it made itself in the full collection it makes as it starts (shardserve/heap.py), not the 180,000
objects of torch and shardserve the server imported (0.1 to 0.25 s a rank on a 2-core machine); its shutdown
unfreezes and collects everything, as it would have."""

import gc

gc.freeze()
