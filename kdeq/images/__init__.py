"""Image files and generated images: reading and checking image files, PNGs written by numpy and
zlib, non-negative maps as scaled 16-bit PNGs, and the sample images each task is tried on.

May import: ``kdeq.maths`` and ``kdeq.runtime``.
"""
