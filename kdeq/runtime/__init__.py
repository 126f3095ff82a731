"""The platform layer: what the rest runs on and how fast — torch's CPU threads sized to the free
cores, glibc's heap kept from mapping fresh memory, files written whole or not at all, and the
implementations measured once per machine and shape class (convolution backends, the guided kernel's
compiled CPU loops, the guide networks' precision).

May import: the standard library, torch and numpy only; nothing of kdeq.
"""
