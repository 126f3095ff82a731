"""OptEq and KerDEQ layers (kdeq.research.optdeq) against independent computations: stationarity of their
energies by autograd, KerDEQ's γ → 0 limit, the patch form as explicit matrices, implicit gradients
against central differences, and the phantom gradient (kdeq.maths.implicit) against its closed form."""

import pytest
import torch

from kdeq import SolverConfig
from kdeq.maths.implicit import equilibrium
from kdeq.research.optdeq import KerDEQ, OptEq, PatchKerDEQ

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
CFG = SolverConfig(tol=1e-12, max_iter=500)
KINDS = ("opteq", "kerdeq", "patch")


def _case(kind: str, activation: str = "tanh", **kw) -> tuple[torch.nn.Module, torch.Tensor]:
    """A float64 layer with a random bias (so ReLU leaves a mix of zero and positive coordinates)
    and an input batch."""
    gen = torch.Generator().manual_seed(3)
    if kind == "opteq":
        layer, x = OptEq(5, 7, 4, activation=activation, solver=CFG, **kw), torch.randn(3, 5, generator=gen)
    elif kind == "kerdeq":
        layer, x = KerDEQ(5, 7, 4, activation=activation, solver=CFG, **kw), torch.randn(3, 5, generator=gen)
    else:
        layer = PatchKerDEQ(1, 2, 2, projection=5, activation=activation, solver=CFG, **kw)
        x = torch.randn(2, 1, 5, 5, generator=gen)
    layer = layer.double()
    with torch.no_grad():
        layer.b.copy_(0.5 * torch.randn(layer.b.shape, generator=gen, dtype=F64))
    return layer, x.double()


def _solve(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        z, stats = layer(x)
    assert bool(stats.converged.all())
    return z


def _energy_grad(layer: torch.nn.Module, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    z = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(layer.energy(z, x).sum(), z)
    return g


@pytest.mark.parametrize("kind", KINDS)
def test_tanh_fixed_point_is_stationary(kind: str) -> None:
    """With a smooth ``f``, ``∇G(z*) = 0``: autograd through ``energy``, not through the map."""
    layer, x = _case(kind, "tanh")
    z = _solve(layer, x)
    g = _energy_grad(layer, z, x)
    assert z.abs().max() > 0.05  # a non-trivial equilibrium
    assert g.abs().max() < 1e-9


@pytest.mark.parametrize("kind", KINDS)
def test_relu_fixed_point_satisfies_kkt(kind: str) -> None:
    """``min G`` over ``z ≥ 0``: the smooth part's gradient vanishes where ``z* > 0`` and is ``≥ 0``
    where ``z* = 0``."""
    layer, x = _case(kind, "relu")
    z = _solve(layer, x)
    g = _energy_grad(layer, z, x)
    # the solver returns an Anderson iterate, whose zero coordinates may be off by rounding
    active = z > 1e-10
    assert 0 < int(active.sum()) < z.numel()
    assert g[active].abs().max() < 1e-9
    assert g[~active].min() > -1e-9
    assert torch.isinf(layer.energy(z - 1e-3, x)).all()  # outside dom f


def test_tanh_penalty_is_the_prox_potential() -> None:
    """``energy``'s ``f`` for tanh: ``f′(z) = artanh z − z``, so that ``z = tanh v`` minimises
    ``f(z) + ½(z − v)²``; and the closed form ``z·artanh z + ½ln(1−z²) − z²/2``."""
    layer = KerDEQ(1, 3, 1, activation="tanh").double()
    x = torch.zeros(1, 1, dtype=F64)
    z = torch.tensor([[-0.9, 0.2, 0.6]], dtype=F64, requires_grad=True)
    # with x = 0, b = 0 the kernel term is (1/2γ)exp(−γ‖Wz‖²); remove it to isolate 1ᵀf(z) + ½‖z‖²
    w = layer.w.detach()
    smooth = layer.energy(z, x) + torch.exp(-layer.gamma * ((z @ w.T) ** 2).sum(1)) / (2 * layer.gamma)
    (g,) = torch.autograd.grad(smooth.sum(), z)
    zd = z.detach()
    torch.testing.assert_close(g, torch.atanh(zd))  # f′(z) + z
    expected = (zd * torch.atanh(zd) + 0.5 * torch.log1p(-(zd**2)) - zd**2 / 2).sum() + 0.5 * (zd**2).sum()
    torch.testing.assert_close(smooth.detach().sum(), expected)
    assert torch.isinf(layer.energy(torch.tensor([[1.5, 0.0, 0.0]], dtype=F64), x)).all()


def test_kerdeq_small_gamma_limit() -> None:
    """As ``γ → 0`` the fixed point tends to that of ``z = σ(Wᵀ(Ux + b − Wz))``, with an ``O(γ)``
    error (solved here by plain iteration: ``‖W‖² < 1``)."""
    errors = []
    for gamma in (1e-1, 1e-2, 1e-3):
        layer, x = _case("kerdeq", "tanh", gamma=gamma)
        z = _solve(layer, x)
        w, inj = layer.w.detach(), x @ layer.u.detach().T + layer.b.detach()
        limit = torch.zeros_like(z)
        for _ in range(200):
            limit = torch.tanh((inj - limit @ w.T) @ w)
        errors.append(((z - limit).norm() / limit.norm()).item())
    assert errors[0] < 0.3
    assert errors[1] < 0.15 * errors[0]
    assert errors[2] < 0.15 * errors[1]


def _conv_matrix(weight: torch.Tensor, size: int) -> torch.Tensor:
    """The zero-padded "same" cross-correlation with ``weight`` ``(co, ci, k, k)`` on ``size × size``
    images as a ``(co·size², ci·size²)`` matrix on ``(channel, row, column)``-flattened images."""
    co, ci, k, _ = weight.shape
    mat = torch.zeros(co, size, size, ci, size, size, dtype=weight.dtype)
    for y in range(size):
        for x in range(size):
            for a in range(k):
                for b in range(k):
                    yy, xx = y + a - k // 2, x + b - k // 2
                    if 0 <= yy < size and 0 <= xx < size:
                        mat[:, y, x, :, yy, xx] = weight[:, :, a, b]
    return mat.reshape(co * size * size, ci * size * size)


def _patch_matrices(channels: int, size: int, patch: int) -> list[torch.Tensor]:
    """``P_j`` ``(channels·patch², channels·size²)`` for each pixel ``j``: the zero-padded patch
    centred on ``j``, flattened as ``(channel, row offset, column offset)``."""
    mats = []
    for y in range(size):
        for x in range(size):
            p = torch.zeros(channels, patch, patch, channels, size, size, dtype=F64)
            for c in range(channels):
                for a in range(patch):
                    for b in range(patch):
                        yy, xx = y + a - patch // 2, x + b - patch // 2
                        if 0 <= yy < size and 0 <= xx < size:
                            p[c, a, b, c, yy, xx] = 1
            mats.append(p.reshape(channels * patch**2, channels * size * size))
    return mats


def test_patch_form_matches_explicit_matrices() -> None:
    """Algorithm 1 as dense algebra: ``r = C_U x + b − C_W z``, ``s_j = W_hᵀP_j r``,
    ``z = tanh(C_Wᵀ Σ_j P_jᵀ exp(−γ‖s_j‖²) W_h s_j)`` and ``G = Σf + ½‖z‖² − (1/2γ)Σ_j exp(−γ‖s_j‖²)``."""
    layer, x = _case("patch", "tanh", gamma=0.7)
    size, c_latent = x.shape[-1], layer.w.shape[0]
    cu, cw = _conv_matrix(layer.u.detach(), size), _conv_matrix(layer.w.detach(), size)
    ps = _patch_matrices(c_latent, size, layer.patch)
    wh, gamma = layer.w_h.detach(), layer.gamma
    inj = x.reshape(x.shape[0], -1) @ cu.T + layer.b.detach().repeat_interleave(size * size)

    def kernel_terms(zf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = inj - zf @ cw.T
        s = torch.stack([r @ p.T @ wh for p in ps], dim=1)  # (B, patches, q)
        e = torch.exp(-gamma * (s**2).sum(-1))  # (B, patches)
        m = sum(((e[:, j, None] * s[:, j]) @ wh.T) @ p for j, p in enumerate(ps))
        return m @ cw, e.sum(1) / (2 * gamma)

    zf = torch.zeros(x.shape[0], cw.shape[1], dtype=F64)
    for _ in range(100):
        zf = torch.tanh(kernel_terms(zf)[0])
    z = _solve(layer, x)
    torch.testing.assert_close(z.reshape(z.shape[0], -1), zf, rtol=1e-9, atol=1e-11)

    probe = 0.8 * torch.rand(z.shape, dtype=F64) - 0.4
    pf = probe.reshape(probe.shape[0], -1)
    f = 0.5 * ((1 + pf) * torch.log1p(pf) + (1 - pf) * torch.log1p(-pf)) - pf**2 / 2
    dense = f.sum(1) + 0.5 * (pf**2).sum(1) - kernel_terms(pf)[1]
    torch.testing.assert_close(layer.energy(probe, x).detach(), dense)


def test_patch_form_on_one_pixel_is_kerdeq() -> None:
    """One pixel, ``k = patch = 1`` and an orthogonal ``W_h``: the patch form is the dense KerDEQ."""
    patch = PatchKerDEQ(3, 6, 4, kernel_size=1, patch=1, activation="tanh", solver=CFG, seed=5).double()
    dense = KerDEQ(3, 6, 4, activation="tanh", solver=CFG, seed=5).double()
    with torch.no_grad():
        dense.w.copy_(patch.w[:, :, 0, 0])
        dense.u.copy_(patch.u[:, :, 0, 0])
        patch.b.copy_(0.5 * torch.randn(4, dtype=F64))
        dense.b.copy_(patch.b)
        patch.w_h.copy_(torch.linalg.qr(torch.randn(4, 4, dtype=F64))[0])
    x = torch.randn(4, 3, dtype=F64)
    z_dense = _solve(dense, x)
    z_patch = _solve(patch, x[:, :, None, None])
    assert z_dense.abs().max() > 0.05
    torch.testing.assert_close(z_patch[:, :, 0, 0], z_dense, rtol=1e-9, atol=1e-11)


def _loss(layer: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    z, stats = layer(x)
    assert bool(stats.converged.all())
    return (c * z).sum() + 0.5 * (z**2).sum()


def _grads(layer: torch.nn.Module, x: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    return list(torch.autograd.grad(_loss(layer, x, c), [*layer.parameters(), x]))


@pytest.mark.parametrize(("kind", "activation"), [(k, "tanh") for k in KINDS] + [("kerdeq", "relu")])
def test_implicit_gradient_matches_central_differences(kind: str, activation: str) -> None:
    """``⟨∇ℓ, v⟩`` (implicit backward) against ``(ℓ(θ + εv) − ℓ(θ − εv))/2ε`` along a random
    direction ``v`` in every parameter and the input."""
    layer, x = _case(kind, activation)
    gen = torch.Generator().manual_seed(11)
    c = torch.randn(_solve(layer, x).shape, generator=gen, dtype=F64)
    params = [*layer.parameters()]
    dirs = [torch.randn(p.shape, generator=gen, dtype=F64) for p in [*params, x]]
    analytic = sum((g * v).sum() for g, v in zip(_grads(layer, x, c), dirs, strict=True))

    def shifted(eps: float) -> float:
        with torch.no_grad():
            for p, v in zip(params, dirs[:-1], strict=True):
                p.add_(eps * v)
            value = _loss(layer, x + eps * dirs[-1], c).item()
            for p, v in zip(params, dirs[:-1], strict=True):
                p.sub_(eps * v)
        return value

    eps = 1e-5
    numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
    assert abs(analytic.item() - numeric) < 1e-6 * max(1.0, abs(numeric))


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    fa, fb = torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])
    return (fa @ fb / (fa.norm() * fb.norm())).item()


@pytest.mark.parametrize("kind", KINDS)
def test_phantom_gradient_approaches_implicit(kind: str) -> None:
    """On a contraction the default phantom gradient (``k = 5``, ``τ = 0.5``) points along the
    implicit one, and more, less damped steps converge to it."""
    layer, x = _case(kind, "tanh")
    c = torch.randn(_solve(layer, x).shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    implicit = _grads(layer, x, c)
    layer.backward = "phantom"
    phantom = _grads(layer, x, c)
    assert _cosine(phantom, implicit) > 0.99
    # ... and is not the implicit gradient itself: five steps leave a visible truncation error
    assert max(((p - i).norm() / i.norm()).item() for p, i in zip(phantom, implicit, strict=True)) > 1e-4
    layer.phantom_steps, layer.phantom_damping = 60, 0.9
    long = _grads(layer, x, c)
    for g_long, g_imp in zip(long, implicit, strict=True):
        torch.testing.assert_close(g_long, g_imp, rtol=1e-7, atol=1e-10)


def test_phantom_gradient_of_an_affine_map_is_its_closed_form() -> None:
    """For ``f(z) = Az + c`` the unrolled steps give ``∂z_k/∂c = τ Σ_{i<k} ((1−τ)I + τA)^i``; the
    returned value is ``z*``."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(6, 6, generator=gen, dtype=F64)
    a *= 0.6 / torch.linalg.matrix_norm(a, ord=2)
    c = torch.randn(2, 6, generator=gen, dtype=F64, requires_grad=True)
    g = torch.randn(2, 6, generator=gen, dtype=F64)
    k, tau = 4, 0.3
    z, stats = equilibrium(
        lambda z: z @ a.T + c,
        torch.zeros(2, 6, dtype=F64),
        CFG,
        "phantom",
        phantom_steps=k,
        phantom_damping=tau,
    )
    assert bool(stats.converged.all())
    torch.testing.assert_close(z.detach(), torch.linalg.solve(torch.eye(6, dtype=F64) - a, c.detach().T).T)
    (grad,) = torch.autograd.grad((g * z).sum(), c)
    step = (1 - tau) * torch.eye(6, dtype=F64) + tau * a
    jac = tau * sum(torch.linalg.matrix_power(step, i) for i in range(k))
    torch.testing.assert_close(grad, g @ jac)
    with pytest.raises(ValueError, match="phantom"):
        equilibrium(lambda z: z @ a.T + c, torch.zeros(2, 6, dtype=F64), CFG, "phantom", phantom_steps=0)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_default_initialisation_converges_and_is_seeded(activation: str) -> None:
    """At their defaults (float32, Anderson, tol 1e-4) the layers converge on unit-variance inputs,
    the equilibrium is non-trivial, and the same seed gives the same parameters."""
    x, img = torch.randn(8, 16), torch.randn(2, 3, 12, 12)
    for make, inp in (
        (lambda s: OptEq(16, 32, 8, activation=activation, seed=s), x),
        (lambda s: KerDEQ(16, 32, 8, activation=activation, seed=s), x),
        (lambda s: PatchKerDEQ(3, 8, 4, activation=activation, seed=s), img),
    ):
        layer = make(0)
        z, stats = layer(inp)
        assert bool(stats.converged.all()) and stats.iterations.max() < 40
        assert z.abs().max() > 1e-3
        again, other = make(0), make(1)
        assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), again.parameters(), strict=True))
        assert not torch.equal(layer.w, other.w)


def test_parameters_train_and_gamma_is_read_only() -> None:
    layer = PatchKerDEQ(1, 2, 2, gamma=0.3)
    assert {n for n, _ in layer.named_parameters()} == {"u", "b", "w", "w_h"}
    assert layer.gamma == 0.3
    with pytest.raises(AttributeError):
        layer.gamma = 1.0  # type: ignore[misc]
    z, _ = layer(torch.randn(2, 1, 6, 6))
    z.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    with pytest.raises(ValueError, match="activation"):
        OptEq(2, 3, 2, activation="softplus")
    with pytest.raises(ValueError, match="gamma"):
        KerDEQ(2, 3, 2, gamma=0.0)
