"""The models: a model's specification and tensors as far as they concern the model alone
(``spec``: architectures, ``λ`` rules, ``ModelSpecBase``, the tensors an architecture needs), the
predictors that run them on a device (``base`` and one module per kind of model), and their
posteriors (``uncertainty``). A predictor knows nothing of tasks, requests or the registry.

May import: ``kdeq.images``, ``kdeq.maths`` and ``kdeq.runtime``.
"""
