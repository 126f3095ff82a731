"""The kGLM mathematics (Tsuchida et al., ICLR 2022; DESIGN §2): families and priors, PSD kernels and
their filter banks, the adaptive (guided) kernel, the kGLM-DEQ layer and its weight mapping, the
fixed-point solvers with implicit gradients, forward operators and their adjoints, noise estimates,
the learned guide networks, and the compiled forms of these operations (fused Triton kernels,
CUDA-graph replay of a solver's steps).

May import: ``kdeq.runtime``.
"""
