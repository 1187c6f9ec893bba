"""A serving process's Python heap: what start-up built, kept out of the cyclic garbage collector's scans.

A decode step at a large batch allocates thousands of short-lived containers (chunks, block-table copies,
outputs), so the collector runs several times a step, and every few dozen steps a full collection walks every
tracked object of the process: the model's modules, the tokenizer, torch's and the server's own, 100 ms and
more at a time, while the device waits for the next step (at TP=2 a decode step of 512 sequences is 12 ms).
Start-up objects live as long as the engine does, so they are moved to the collector's permanent generation
once start-up is done (engine ranks, API server processes); the collector then walks only what serving
created. Objects in that generation are never collected even when they become cyclic garbage, so whatever
froze them gives them back when it shuts down.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect what start-up left behind, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


def release_startup_objects(collect: bool = True) -> None:
    """Undo freeze_startup_objects (at shutdown): the frozen objects are collectable again. With `collect` (an
    engine on GPUs), a collection frees at once any of them that only cycles keep alive (an engine started again
    in the same process must not find the last one's device memory still held); without (host memory, which waits
    for nothing), the collector's next full pass does, rather than every shutdown walking the whole process."""
    gc.unfreeze()
    if collect:
        gc.collect()
