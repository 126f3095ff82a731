"""The models: a model's specification and tensors as far as they concern the model alone
(``spec``: architectures, ``λ`` rules, ``ModelSpecBase``, the tensors an architecture needs), the
predictors that run them on a device (``base`` and one module per kind of model), with the rules
their checkpoints obey (``Predictor.check_spec``), and their posteriors (``uncertainty``). A
predictor knows nothing of tasks, requests or the registry (its ``task`` is the name its checkpoints
carry).

May import: ``kdeq.images``, ``kdeq.maths`` and ``kdeq.runtime``.
"""
