"""The collaborative filter (``kdeq.maths.collab``): its transforms against their formulas (the wavelets'
against periodic filtering and their defining properties), its groups against a brute-force search
over explicit patches (by the compiled selection and by torch's), perfect reconstruction where
nothing is shrunk, each stage against a float64 computation written out group by group, its reach on
crops, what it keeps of a repeated texture that a weighted mean of matches loses and what each first
stage keeps; its use by the refinement (``Refine.estimate``)."""

import math

import numpy as np
import pytest
import torch

from kdeq.maths import collab
from kdeq.maths.adaptive import GuidedOperator
from kdeq.maths.guidenet import Refine
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir
from kdeq.runtime import native
from kdeq.serving.tiling import WINDOW_ALIGN
from tests.helpers import assert_refinement_alone_retrained


def test_the_transforms_are_the_orthonormal_dct_and_haar() -> None:
    n = 7
    d = collab.dct_matrix(n).numpy()
    j = np.arange(n)
    for k in range(n):
        scale = math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n)
        assert np.allclose(d[k], scale * np.cos(np.pi * (2 * j + 1) * k / (2 * n)))
    assert np.allclose(d @ d.T, np.eye(n))
    for k in (1, 2, 4, 16):
        h = collab.haar_matrix(k).numpy()
        assert np.allclose(h @ h.T, np.eye(k))
        assert np.allclose(h[0], 1 / math.sqrt(k))
    # the finest rows are neighbour differences; the second row halves against halves
    h = collab.haar_matrix(8).numpy()
    assert np.allclose(h[-1], np.r_[np.zeros(6), 1, -1] / math.sqrt(2))
    assert np.allclose(h[1], np.r_[np.ones(4), -np.ones(4)] / math.sqrt(8))
    with pytest.raises(ValueError, match="power of two"):
        collab.haar_matrix(6)


def periodic_wavelets(x: np.ndarray) -> np.ndarray:
    """The full-depth periodic ``bior1.5`` transform of ``x`` ``(n,)`` written as filtering: each level
    takes, at every second position ``2k`` of the approximation wrapped around, the dot product of the
    ten pixels from ``2k − 4`` with the analysis low-pass (``collab.BIOR_LOW``), and Haar's difference
    of the pair ``(2k, 2k + 1)``, then recurses on the former."""
    low = math.sqrt(2) / 256 * np.array(collab.BIOR_LOW, dtype=float)
    details = []
    a = x.astype(float)
    while a.size > 1:
        m = a.size
        # a_k = Σ_t ℓ_t·a_(2k + t), t = −4…5: the wrapped signal from index −4 (mod m) on
        wrapped = a[np.arange(-4, m + 6) % m]
        a_next = np.array([np.dot(low, wrapped[2 * k : 2 * k + 10]) for k in range(m // 2)])
        details.insert(0, (a[0::2] - a[1::2]) / math.sqrt(2))
        a = a_next
    return np.concatenate([a, *details])


def test_the_wavelet_transform_is_bior15_by_periodic_filtering() -> None:
    """``biorthogonal_matrix`` is the periodic filtering above; its analysis low-pass has the defining
    properties of Cohen–Daubechies–Feauveau's (1, 5) spline filter (symmetric, summing to √2, dual to
    Haar's box at every even shift, five zeros at ω = π); its inverse synthesises with Haar's box (the
    coarsest coefficient's column of ``B⁻¹`` is constant) and one wavelet per level, shifted."""
    low = math.sqrt(2) / 256 * np.array(collab.BIOR_LOW, dtype=float)
    t = np.arange(-4, 6)
    assert np.allclose(low, low[::-1]) and math.isclose(low.sum(), math.sqrt(2))
    for shift in range(-2, 3):  # ⟨ℓ, box shifted by 2k⟩ = δ_k, the box (1, 1)/√2 on (2k, 2k + 1)
        pair = (t == 2 * shift) | (t == 2 * shift + 1)
        assert math.isclose(low[pair].sum() / math.sqrt(2), float(shift == 0), abs_tol=1e-15)
    for power in range(5):
        assert abs(np.sum((-1.0) ** t * t**power * low)) < 1e-9
    gen = np.random.default_rng(0)
    for n in (2, 4, 8, 16):
        b = collab.biorthogonal_matrix(n).numpy()
        for x in gen.standard_normal((3, n)):
            assert np.allclose(b @ x, periodic_wavelets(x), atol=1e-12)
        inverse = np.linalg.inv(b)
        assert np.allclose(inverse[:, 0], 1 / math.sqrt(n))
    inverse = np.linalg.inv(collab.biorthogonal_matrix(8).numpy())
    # the finest details' synthesis wavelets are one wavelet moved by two pixels at a time
    for k in range(4):
        assert np.allclose(inverse[:, 4 + k], np.roll(inverse[:, 4], 2 * k))
    norms = np.linalg.norm(collab.biorthogonal_matrix(8).numpy(), axis=1)
    assert norms.min() > 1 - 1e-12 and norms.max() < 1.06
    with pytest.raises(ValueError, match="power of two"):
        collab.biorthogonal_matrix(6)


def explicit_patches(image: np.ndarray, p: int) -> dict[tuple[int, int], np.ndarray]:
    """Each pixel's ``(2p+1)²·c`` patch of ``image`` ``(c, H, W)`` mirrored at its borders (numpy's
    ``reflect``)."""
    padded = np.pad(image, ((0, 0), (p, p), (p, p)), mode="reflect")
    _, height, width = image.shape
    return {
        (i, j): padded[:, i : i + 2 * p + 1, j : j + 2 * p + 1].reshape(-1)
        for i in range(height)
        for j in range(width)
    }


@pytest.mark.parametrize(
    ("r", "p"),
    [
        (collab.SEARCH_RADIUS, collab.PATCH_RADIUS),
        (4, collab.PATCH_RADIUS),
        (12, collab.PATCH_RADIUS),
        (7, 4),
        (4, 1),
    ],
)
@pytest.mark.parametrize("loops", ["native", "loop"])
def test_groups_are_the_nearest_patches_of_the_window(r, p, loops) -> None:
    """Every reference's group is itself, then the patches (radius ``p``) of its window (radius ``r``)
    nearest to it, by a brute-force search over explicit patches (a random image), by the compiled
    selection and by torch's."""
    gen = torch.Generator().manual_seed(0)
    image = torch.rand(2, 23, 31, generator=gen)
    with native.choice.force(loops):
        refs, members = collab.matches(image, 0.1, 8, r, p)
    patches = explicit_patches(image.double().numpy(), p)
    height, width = image.shape[1:]
    assert refs.tolist() == [i * width + j for i in collab.grid(height) for j in collab.grid(width)]
    for ref, group in zip(refs.tolist(), members.tolist(), strict=True):
        i, j = divmod(ref, width)
        window = [
            (a, b)
            for a in range(max(0, i - r), min(height, i + r + 1))
            for b in range(max(0, j - r), min(width, j + r + 1))
            if (a, b) != (i, j)
        ]
        distance = {z: np.sum((patches[z] - patches[(i, j)]) ** 2) for z in window}
        nearest = sorted(window, key=distance.get)[:7]
        assert group[0] == ref
        members = [divmod(m, width) for m in group[1:]]
        # the same patches, but for near-ties that float32 cannot order (9×9 patches meet one here,
        # 6e-7 apart): then the same distances, each from a distinct patch of the window
        assert members == nearest or (
            len(set(members)) == 7
            and set(members) <= set(window)
            and np.allclose([distance[z] for z in members], [distance[z] for z in nearest], rtol=1e-6)
        )


def test_nothing_shrunk_gives_the_image_back(monkeypatch) -> None:
    """With a threshold of 0 (hard) or a pilot whose every coefficient dwarfs σ (Wiener), the
    transforms are inverted and the aggregation normalised: the image comes back."""
    gen = torch.Generator().manual_seed(1)
    y = torch.rand(1, 29, 34, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(collab, "THRESHOLD", 0.0)
    assert torch.allclose(collab.filtered(y, y, 0.1, "hard"), y, atol=1e-12)
    # the wavelets are not orthonormal, but read back through their inverse
    assert torch.allclose(
        collab.filtered(y, y, 0.1, "hard", patch_radius=4, basis="biorthogonal"), y, atol=1e-12
    )
    # y + 10 matches as y does (distances ignore a shift), and its every coefficient dwarfs σ
    assert torch.allclose(collab.filtered(y, y + 10, 1e-9, "wiener"), y, atol=1e-9)


@pytest.mark.parametrize("p", [collab.PATCH_RADIUS, 4])
@pytest.mark.parametrize(("height", "width"), [(2, 2), (3, 5), (3, 40)])
def test_images_smaller_than_a_patch_are_filtered(monkeypatch, height, width, p) -> None:
    """Sides under a patch's (edge-repeated where a mirror does not fit): a finite estimate, and the
    image back with nothing shrunk."""
    y = torch.rand(1, height, width, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out = collab.collaborative(y, 0.1, patch_radius=p)
    assert out.shape == y.shape and torch.isfinite(out).all()
    if p == 4:
        out = collab.collaborative(y, 0.1, patch_radius=p, first_stage="dct+biorthogonal")
        assert out.shape == y.shape and torch.isfinite(out).all()
    monkeypatch.setattr(collab, "THRESHOLD", 0.0)
    assert torch.allclose(collab.filtered(y, y, 0.1, "hard", patch_radius=p), y, atol=1e-12)


def dense_stage(
    y: np.ndarray, guide: np.ndarray, pilot: np.ndarray, sigma: float, stage: str, p: int, basis: str = "dct"
) -> np.ndarray:
    """One stage written out group by group in float64 (``y``, ``guide``, ``pilot`` ``(c, H, W)``,
    patches of radius ``p``): the groups of ``collab.matches`` on ``guide``, each member's explicit
    mirrored patch (for the wavelets its ``2p``-pixel part from ``−(p − 1)``), the 3-D transform as
    ``H_K · X · Tᵀ`` (``T = D ⊗ D``, or ``B ⊗ B`` by ``periodic_wavelets``), the stage's shrinkage (a
    coefficient's threshold ``λσ`` times its row's norm) and weight, the inverse, and each pixel the
    weighted mean of its estimates (Kaiser-windowed)."""
    c, height, width = y.shape
    n, first = (2 * p + 1, 0) if basis == "dct" else (2 * p, 1)
    group = collab.GROUP_HARD if stage == "hard" else collab.GROUP_WIENER
    _, members = collab.matches(torch.from_numpy(guide).float(), sigma, group, patch_radius=p)
    k = 1 << (members.shape[1].bit_length() - 1)
    members = members[:, :k].numpy()
    if basis == "dct":
        side = collab.dct_matrix(n).numpy()
    else:
        side = np.stack([periodic_wavelets(e) for e in np.eye(n)], axis=1)
    t = np.kron(side, side)
    t_inv = np.linalg.inv(t)
    h = collab.haar_matrix(k).numpy()
    kaiser = np.kaiser(n, collab.KAISER_BETA)
    window = np.outer(kaiser, kaiser).reshape(-1)
    part = (slice(None), slice(first, first + n), slice(first, first + n))
    m = 2 * p + 1
    noisy, clean = explicit_patches(y, p), explicit_patches(pilot, p)
    total = np.zeros((c, height + 2 * p, width + 2 * p))
    mass = np.zeros((height + 2 * p, width + 2 * p))
    for group in members:
        centres = [divmod(int(m), width) for m in group]
        x = np.stack([noisy[z].reshape(c, m, m)[part].reshape(c, n * n) for z in centres])  # (K, c, n²)
        spectrum = np.einsum("ij,jcq,rq->icr", h, x, t)
        if stage == "hard":
            threshold = collab.THRESHOLD * sigma * np.linalg.norm(t, axis=1)
            spectrum = spectrum * (np.abs(spectrum) >= threshold)
            weight = 1 / max(np.count_nonzero(spectrum), 1)
        else:
            b = np.stack([clean[z].reshape(c, n * n) for z in centres])
            power = np.einsum("ij,jcq,rq->icr", h, b, t) ** 2
            shrink = power / (power + sigma**2)
            spectrum = spectrum * shrink
            weight = 1 / np.sum(shrink**2)
        estimate = np.einsum("ji,jcr,qr->icq", h, spectrum, t_inv)
        for (i, j), patch in zip(centres, estimate, strict=True):
            rows, cols = slice(i + first, i + first + n), slice(j + first, j + first + n)
            total[:, rows, cols] += weight * window.reshape(n, n) * patch.reshape(c, n, n)
            mass[rows, cols] += weight * window.reshape(n, n)
    # (the wavelets' patches leave the canvas's first row and column uncovered: outside the image)
    inside = (slice(p, p + height), slice(p, p + width))
    return total[:, inside[0], inside[1]] / mass[inside]


@pytest.mark.parametrize(
    ("channels", "stage", "p", "basis"),
    [
        (1, "hard", 3, "dct"),
        (1, "wiener", 3, "dct"),
        (3, "hard", 3, "dct"),
        (3, "wiener", 3, "dct"),
        (1, "hard", 4, "dct"),
        (1, "wiener", 4, "dct"),
        (1, "hard", 4, "biorthogonal"),
        (3, "hard", 2, "biorthogonal"),
    ],
)
def test_each_stage_is_the_group_by_group_computation(channels, stage, p, basis) -> None:
    gen = torch.Generator().manual_seed(2)
    clean = torch.linspace(0, 1, 26)[None, :, None] * torch.linspace(0.2, 0.8, 21)[None, None, :]
    clean = clean.expand(channels, -1, -1) + 0.2 * torch.sin(torch.arange(21.0) * 1.3)
    sigma = 0.08
    y = clean + sigma * torch.randn(channels, 26, 21, generator=gen)
    guide = y if stage == "hard" else collab.filtered(y, y, sigma, "hard", patch_radius=p)
    ours = collab.filtered(y, guide, sigma, stage, patch_radius=p, basis=basis)
    double = (y.double().numpy(), guide.double().numpy(), guide.double().numpy())
    dense = dense_stage(*double, sigma, stage, p, basis)
    assert np.allclose(ours.numpy(), dense, atol=2e-5)


def test_the_wavelets_are_the_first_stage_only() -> None:
    y = torch.rand(1, 20, 20, generator=torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="no 'biorthogonal' basis"):
        collab.filtered(y, y, 0.1, "wiener", patch_radius=4, basis="biorthogonal")
    with pytest.raises(ValueError, match="power of two"):
        collab.filtered(y, y, 0.1, "hard", patch_radius=3, basis="biorthogonal")
    with pytest.raises(ValueError, match="first stage"):
        collab.collaborative(y, 0.1, first_stage="wavelets")


@pytest.mark.parametrize("p", [collab.PATCH_RADIUS, 4])
def test_filtering_a_few_groups_at_a_time_gives_the_same_estimate(monkeypatch, p) -> None:
    """The groups are filtered a chunk at a time (fewer at once for larger patches): with chunks of a
    group or two, each stage's estimate is the one-chunk estimate (up to float64 rounding)."""
    y = torch.rand(1, 40, 47, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    basic = collab.filtered(y, y, 0.1, "hard", patch_radius=p)
    second = collab.filtered(y, basic, 0.1, "wiener", patch_radius=p)
    wavelets = collab.filtered(y, y, 0.1, "hard", patch_radius=4, basis="biorthogonal")
    monkeypatch.setattr(collab, "CPU_CHUNK", 2)
    assert torch.allclose(collab.filtered(y, y, 0.1, "hard", patch_radius=p), basic, atol=1e-12)
    assert torch.allclose(collab.filtered(y, basic, 0.1, "wiener", patch_radius=p), second, atol=1e-12)
    again = collab.filtered(y, y, 0.1, "hard", patch_radius=4, basis="biorthogonal")
    assert torch.allclose(again, wavelets, atol=1e-12)


def stripes(height: int, width: int) -> torch.Tensor:
    """A clean grey image ``(1, H, W)`` like Barbara's cloth: diagonal stripes of period 6 whose
    contrast swells and fades down the image, over a fainter crossing pattern of period 9."""
    i, j = torch.meshgrid(torch.arange(height).float(), torch.arange(width).float(), indexing="ij")
    contrast = 0.15 + 0.15 * torch.sin(2 * math.pi * i / 37)
    stripe = contrast * torch.sin(2 * math.pi * (i + 2 * j) / 6)
    return (0.5 + stripe + 0.1 * torch.cos(2 * math.pi * (j - i) / 9))[None]


def psnr(x: torch.Tensor, clean: torch.Tensor) -> float:
    return float(-10 * torch.log10((x.clamp(0, 1) - clean).square().mean()))


def test_repeated_texture_is_kept_where_a_mean_of_matches_loses_it() -> None:
    """Stripes at σ = 25 whose contrast varies: the filter restores them better than the non-local mean
    of the same window and patches (``GuidedOperator.nonlocal_mean`` guided by ``y``, its bandwidth the
    best of five) by more than 1 dB, and its second stage improves on its first (by ~1 dB here)."""
    clean = stripes(64, 72)
    sigma = 25 / 255
    y = clean + sigma * torch.randn(clean.shape, generator=torch.Generator().manual_seed(3))
    basic = collab.filtered(y, y, sigma, "hard")
    both = collab.collaborative(y, sigma)
    taps = torch.ones(2 * collab.SEARCH_RADIUS + 1, 2 * collab.SEARCH_RADIUS + 1)
    n2 = (2 * collab.PATCH_RADIUS + 1) ** 2
    means = []
    for scale in (0.1, 0.25, 0.5, 1.0, 2.0):
        op = GuidedOperator(y[None], taps, collab.PATCH_RADIUS, torch.tensor([scale * n2 * sigma**2]), True)
        means.append(psnr(op.nonlocal_mean(y[None], 1, patches=True)[0][0], clean))
    assert psnr(both, clean) > max(psnr(basic, clean) + 0.5, max(means) + 1.0)


def test_the_wavelets_keep_edges_and_the_dct_stripes() -> None:
    """At σ = 25, on the same groups: on flat regions with straight and curved edges (House's kind) the
    wavelets' first stage is more than 0.4 dB above the DCT's, and the filter piloted by their mean
    more than 0.15 dB above the DCT's alone; on stripes (Barbara's kind) the DCT's first stage is more
    than 1 dB above the wavelets'."""
    i, j = torch.meshgrid(torch.arange(96.0), torch.arange(96.0), indexing="ij")
    disc = ((i - 70) ** 2 + (j - 20) ** 2 < 200).float()
    blocks = (0.3 + 0.4 * (i > 40) * (j > 30) + 0.2 * (i + j > 100) + 0.1 * disc)[None]
    sigma = 25 / 255
    first = {}
    for name, clean in (("blocks", blocks), ("stripes", stripes(96, 96))):
        y = clean + sigma * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
        groups = collab.matches(y, sigma, collab.GROUP_HARD, 7, 4)
        dct = collab.filtered(y, y, sigma, "hard", 7, 4, groups=groups)
        wavelets = collab.filtered(y, y, sigma, "hard", 7, 4, "biorthogonal", groups)
        first[name] = psnr(wavelets, clean) - psnr(dct, clean)
        if name == "blocks":
            both = collab.collaborative(y, sigma, 7, 4, "dct+biorthogonal")
            assert psnr(both, clean) > psnr(collab.collaborative(y, sigma, 7, 4), clean) + 0.15
    assert first["blocks"] > 0.4 and first["stripes"] < -1.0


@pytest.mark.parametrize(
    ("r", "p", "first"),
    [
        (collab.SEARCH_RADIUS, collab.PATCH_RADIUS, "dct"),
        (4, collab.PATCH_RADIUS, "dct"),
        (4, 4, "dct"),
        (4, 4, "dct+biorthogonal"),
    ],
)
def test_a_crop_on_the_grid_is_exact_beyond_the_reach(r, p, first) -> None:
    """A crop whose origin is on the reference grid (a multiple of ``WINDOW_ALIGN``, as a tile's window
    is) estimates its pixels ``reach(r, p)`` in from its borders as the whole image does, whichever the
    first stage (the wavelets' patches lie within ``p`` of their centres too); a crop off the grid
    does not."""
    gen = torch.Generator().manual_seed(4)
    clean = stripes(140, 150)
    y = clean + 0.1 * torch.randn(clean.shape, generator=gen)
    whole = collab.collaborative(y, 0.1, r, p, first)
    reach = collab.reach(r, p)
    assert WINDOW_ALIGN % collab.STEP == 0
    for top, left in [(WINDOW_ALIGN, 2 * WINDOW_ALIGN), (0, WINDOW_ALIGN)]:
        crop = collab.collaborative(y[:, top : top + 100, left : left + 110], 0.1, r, p, first)
        inner = (slice(None), slice(reach, 100 - reach), slice(reach, 110 - reach))
        expected = whole[:, top : top + 100, left : left + 110][inner]
        assert torch.allclose(crop[inner], expected, atol=1e-5)
    off = collab.collaborative(y[:, 1:101, 2:112], 0.1, r, p, first)
    assert not torch.allclose(
        off[:, reach:-reach, reach:-reach], whole[:, 1:101, 2:112][:, reach:-reach, reach:-reach], atol=1e-3
    )


def test_a_padded_batch_gives_each_image_its_own_estimate() -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = torch.rand(1, 30, 40, generator=gen), torch.rand(1, 24, 33, generator=gen)
    batch = torch.zeros(2, 1, 30, 40)
    batch[0], batch[1, :, :24, :33] = a, b
    sigma = torch.tensor([0.0625, 0.25])
    out = collab.each_collaborative(batch, sigma, [(30, 40), (24, 33)])
    assert torch.equal(out[0], collab.collaborative(a, 0.0625))
    assert torch.equal(out[1, :, :24, :33], collab.collaborative(b, 0.25))
    assert not out[1, :, 24:].any() and not out[1, :, :, 33:].any()


def test_the_spread_alone_is_the_nonlocal_means() -> None:
    gen = torch.Generator().manual_seed(6)
    guide, v = torch.rand(2, 1, 20, 27, generator=gen), torch.rand(2, 1, 20, 27, generator=gen)
    taps = torch.ones(7, 7)
    op = GuidedOperator(guide, taps, 1, torch.tensor([0.05, 0.1]), True)
    for patches in (False, True):
        assert torch.equal(op.match_spread(v, 3), op.nonlocal_mean(v, 3, patches=patches)[1])


def test_the_estimate_option_is_written_only_when_set() -> None:
    assert "estimate" not in Refine().model_dump()
    chosen = Refine(estimate="collaborative")
    assert chosen.model_dump()["estimate"] == "collaborative"
    assert Refine.model_validate(chosen.model_dump()) == chosen
    with pytest.raises(ValueError):
        Refine(estimate="bm3d")


@pytest.mark.parametrize(
    "options",
    [{}, {"search_radius": 5, "patch_radius": 2}, {"patch_radius": 2, "first_stage": "dct+biorthogonal"}],
)
def test_the_refinement_reads_the_filter_for_grey_images_and_the_mean_for_colour(
    monkeypatch, options
) -> None:
    """``refined_pilot`` with ``estimate = "collaborative"`` hands ``H_φ`` (here a stand-in that records
    its ``ν``) the filter's estimate for a grey image, with the model's window, patches and first
    stage, and the non-local mean for a colour one."""
    from kdeq.maths import refine as R

    seen = {}

    def fake_refined(y, p, nu, spread, sigma, tensors, refine):
        seen[y.shape[1]] = nu
        return p

    monkeypatch.setattr(R, "_refined", fake_refined)
    gen = torch.Generator().manual_seed(7)
    cfg = Refine(estimate="collaborative", aggregate="patch", colour_channels=4, **options)
    for channels in (1, 3):
        y = torch.rand(1, channels, 24, 30, generator=gen)
        op = GuidedOperator(y, torch.ones(5, 5), 1, torch.tensor([0.05]), True)
        R.refined_pilot(op, y, y, torch.tensor([0.1]), {}, cfg)
        if channels == 1:
            radii = (cfg.search_radius, cfg.patch_radius)
            expected = collab.each_collaborative(y, torch.tensor([0.1]), None, *radii, cfg.first_stage)
            assert torch.equal(seen[1], expected)
            if options:
                assert not torch.equal(seen[1], collab.each_collaborative(y, torch.tensor([0.1])))
        else:
            assert torch.equal(seen[3], op.nonlocal_mean(y, cfg.sharpness, patches=True)[0])


def test_the_shipped_collaborative_model_is_x8_with_the_filter() -> None:
    """``denoise-kglm-collab:1`` is ``denoise-kglm-x8:1`` whose grey refinement reads the filter: the
    same kernel, λ, mean, solver and guide network bit for bit; only the refinement ``H_φ`` and ``β``
    were trained again (docs/training.md)."""
    root = default_models_dir()
    if not (root / "denoise-kglm-collab").is_dir():
        pytest.skip(f"no denoise-kglm-collab in {root}")
    x8 = load_checkpoint(root / "denoise-kglm-x8" / "1")
    model = load_checkpoint(root / "denoise-kglm-collab" / "1")
    refine = model.config.architecture.net.refine
    assert refine.estimate == "collaborative"
    net = model.config.architecture.net.model_copy(
        update={"refine": refine.model_copy(update={"estimate": "nonlocal"})}
    )
    assert model.config.architecture.model_copy(update={"net": net}) == x8.config.architecture
    assert_refinement_alone_retrained(model, x8)
