"""What a server or a batch run does with a loaded model beyond one ``predict`` call: images of any
size solved a tile at a time (``tiling``), and a task over many files in one process, batched
where a batch is faster (``batchrun``).

May import: ``kdeq.models``, ``kdeq.registry`` and everything below them.
"""
