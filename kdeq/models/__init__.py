"""Checkpoints and the repository, above the task registry: ``ModelSpec`` held to its task's rules,
``config.json`` and the weights validated on load and written whole, the shipped specs built in
closed form from their kernels (``kdeq init``), and ``models/<name>/<version>`` listed, found and
loaded as its task's predictor.

May import: ``kdeq.registry`` and everything below it.
"""
