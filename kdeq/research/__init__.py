"""Research experiments, not served: the other equilibrium models of the literature (DESIGN §2.11) —
monotone DEQs, OptEq and KerDEQ — and the experiments that compare them with the kGLM-DEQ
(``kdeq experiment``).

May import: ``kdeq.train`` and everything below it.
"""
