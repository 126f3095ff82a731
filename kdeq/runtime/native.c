/* The guided kernel's offset loops fused, for the CPU (kdeq.runtime.native builds and loads this file).

   Each function computes a few rows [r0, r1) of every image of a batch, so that threads may share
   an image by rows; it reads what it needs from the other rows and writes only its own. Every
   output pixel's sums are taken in one fixed order (offsets in the order given, the box's terms
   left to right and top to bottom), whatever the rows asked for or the image's size, and the file
   is compiled without contracting products and sums into fused multiply-adds, so that a vector
   lane and the scalar remainder round alike: a pixel's value depends on its neighbourhood only.

   Compiled twice, with REAL float (names ending _f) and double (_d). Arrays are contiguous,
   row-major: maps (B, channels, H, W). An offset o_j = (da[j], db[j]) is (row, column). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

typedef REAL real;

/* rows of a map read together, a block of rows at a time for each offset: whole cache lines and
   pages in order, rather than a row from every map in turn */
#define ROWS 8
#define PATCH_ROWS 32

static int lo(int a, int b) { return a < b ? a : b; }
static int hi(int a, int b) { return a > b ? a : b; }
static long lo_l(long a, long b) { return a < b ? a : b; }
static long hi_l(long a, long b) { return a > b ? a : b; }

/* u[x] ← u[x]^k for x in [x0, x1), k ≥ 1: the odd part by repeated products (tmp holds the base),
   then squarings (kdeq.maths.adaptive._power_'s order). */
static void NAME(power)(real *u, real *tmp, long x0, long x1, int k) {
    int twos = 0;
    while (!(k & 1)) {
        k >>= 1;
        ++twos;
    }
    if (k > 1) {
        memcpy(tmp + x0, u + x0, sizeof(real) * (size_t)(x1 - x0));
        for (int i = 1; i < k; ++i)
            for (long x = x0; x < x1; ++x) u[x] *= tmp[x];
    }
    for (int t = 0; t < twos; ++t)
        for (long x = x0; x < x1; ++x) u[x] *= u[x];
}

/* u[x] ← (s·w[x])^k for x in [x0, x1). */
static void NAME(matches)(real *u, real *tmp, const real *w, real s, int k, long x0, long x1) {
    for (long x = x0; x < x1; ++x) u[x] = w[x] * s;
    if (k > 1) NAME(power)(u, tmp, x0, x1, k);
}

/* out[x] = in[x] + in[x + step] + … + in[x + (m − 1)·step] for x in [x0, x1), added in that order: a box
   of m terms along a row (step 1) or down rows (step their stride). The patches' sizes are calls of
   their own, so that the compiler unrolls the terms and keeps each sum in a register. */
static inline void NAME(box_m)(real *restrict out, const real *restrict in, long step, int m, int x0, int x1) {
    for (int x = x0; x < x1; ++x) {
        real acc = in[x];
        for (int k = 1; k < m; ++k) acc += in[x + k * step];
        out[x] = acc;
    }
}

static void NAME(box)(real *restrict out, const real *restrict in, long step, int m, int x0, int x1) {
    switch (m) {
    case 3: NAME(box_m)(out, in, step, 3, x0, x1); break;
    case 5: NAME(box_m)(out, in, step, 5, x0, x1); break;
    case 7: NAME(box_m)(out, in, step, 7, x0, x1); break;
    case 9: NAME(box_m)(out, in, step, 9, x0, x1); break;
    default: NAME(box_m)(out, in, step, m, x0, x1);
    }
}

/* out[b,ch,y] += Σ_j u_j(y)·in[b,ch,y+o_j] + Σ_{j: o_j ≠ 0} u_j(y−o_j)·in[b,ch,y−o_j] (y a pixel (row,
   column), terms outside the image left out), u_j = (scale[j]·w[b, index[j]])^power, for the rows
   y of [r0, r1). With best (B, 1, H, W): best[b,y] ← the largest of it and every u_j that reaches y
   either way. w (B, O, H, W), with w_j(y) = 0 wherever y + o_j is outside the image (as
   kdeq.maths.adaptive.guided_weights makes them); in (B, C, H, W), finite; out (B, C, H, W).

   Each map row u_j(z, ·) is read once and serves both of its pairs: (z, z+o_j), adding to row z, and
   (z, z−o_j) seen from z+o_j, adding to row z+a_j. A block of ROWS rows is one run of memory: a term
   whose column leaves the image wraps into the next row, weighed 0. A pixel's terms arrive in the
   order of (block, j, z), the blocks aligned on the image, whatever [r0, r1): rows z from
   r0 − max|a_j|, so that a band also reads the rows above it. */
static int NAME(pairs_rows)(const real *w, int O, const int *index, const int *da, const int *db,
                             const real *scale, int n, int power, const real *in, int C, real *out,
                             real *best, int B, int H, int W, int r0, int r1) {
    size_t plane = (size_t)H * W;
    real *buf = malloc(sizeof(real) * (size_t)2 * ROWS * W);
    if (!buf) return 1;
    int reach = 0;
    for (int j = 0; j < n; ++j) reach = hi(reach, hi(da[j], -da[j]));
    for (int b = 0; b < B; ++b) {
        const real *wb = w + (size_t)b * O * plane, *ib = in + (size_t)b * C * plane;
        real *ob = out + (size_t)b * C * plane, *bb = best ? best + (size_t)b * plane : NULL;
        int z0 = hi(0, r0 - reach), z1 = lo(H, r1 + reach);
        for (int block = z0 - z0 % ROWS; block < z1; block += ROWS)
            for (int j = 0; j < n; ++j) {
                int a = da[j], c = db[j], x0 = hi(0, -c), x1 = lo(W, W - c);
                /* the block's rows whose pair is in the image, as one run of memory [f0, f1); of it, the
                   terms that add to rows [r0, r1) ahead (at f) and back (at f + shift): a wrapped
                   term adds 0, but only to this band's rows, which no other thread writes */
                int zs = hi(hi(block, z0), -a), ze = lo(lo(block + ROWS, z1), H - a);
                if (x1 <= x0 || ze <= zs) continue;
                long f0 = (long)zs * W + x0, f1 = (long)(ze - 1) * W + x1, shift = (long)a * W + c;
                long ua = hi_l(f0, (long)r0 * W), ub = lo_l(f1, (long)r1 * W);
                long va = hi_l(f0, (long)r0 * W - shift), vb = lo_l(f1, (long)r1 * W - shift);
                if (a == 0 && c == 0) vb = va;
                if (ub <= ua && vb <= va) continue;
                real *u = buf - f0, *tmp = buf + ROWS * W - f0;
                NAME(matches)(u, tmp, wb + (size_t)index[j] * plane, scale[j], power, f0, f1);
                for (int ch = 0; ch < C; ++ch) {
                    const real *src = ib + ch * plane;
                    real *dst = ob + ch * plane;
                    for (long f = ua; f < ub; ++f) dst[f] += u[f] * src[f + shift];
                    for (long f = va; f < vb; ++f) dst[f + shift] += u[f] * src[f];
                }
                if (bb) {
                    for (long f = ua; f < ub; ++f) bb[f] = bb[f] < u[f] ? u[f] : bb[f];
                    for (long f = va; f < vb; ++f) bb[f + shift] = bb[f + shift] < u[f] ? u[f] : bb[f + shift];
                }
            }
    }
    free(buf);
    return 0;
}

/* Each exported function runs its rows in bands, one per thread, and returns 0, or 1 where a thread
   could not allocate its row buffers (its rows then not computed). */
int NAME(kdeq_pairs)(const real *w, int O, const int *index, const int *da, const int *db,
                     const real *scale, int n, int power, const real *in, int C, real *out, real *best,
                     int B, int H, int W, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        failed |= NAME(pairs_rows)(w, O, index, da, db, scale, n, power, in, C, out, best, B, H, W,
                                   H * t / k, H * (t + 1) / k);
    }
    return failed;
}

/* The patch-aggregated pairs: out[b,ch,q] += Σ_j S_j(q)·in[b,ch,q+o_j] + S_j(q−o_j)·in[b,ch,q−o_j],
   S_j(q) = Σ_{|d|≤p} s_j(q+d) (a box over patch centres, rows then columns in order, each row's
   terms left to right), s_j(z) = (scale[j]·w[b,index[j]](z))^power · t(z) · t(z+o_j), 0 unless z
   and z+o_j are in the image; t (B, 1, H, W); for the rows q of [r0, r1). w (B, O, H, W), 0 where
   z + o_j is outside the image; in, out (B, C, H, W).

   A block of PATCH_ROWS rows of S_j at a time, for every j in turn, so that the block's rows of out
   stay in cache; its rows' horizontal sums are made with 2p rows more on each side. A pixel's terms
   arrive in the order of (block, j), the blocks aligned on the image, whatever [r0, r1). */
static int NAME(patch_rows)(const real *w, int O, const int *index, const int *da, const int *db,
                             const real *scale, int n, int power, const real *t, int p, const real *in,
                             int C, real *out, int B, int H, int W, int r0, int r1) {
    size_t plane = (size_t)H * W;
    int m = 2 * p + 1, reach = 0;
    for (int j = 0; j < n; ++j) reach = hi(reach, hi(da[j], -da[j]));
    real *buf = malloc(sizeof(real) * ((size_t)(PATCH_ROWS + 2 * p + 4) * W + 2 * p));
    if (!buf) return 1;
    real *rows = buf, *sums = rows + (size_t)(PATCH_ROWS + 2 * p) * W, *u = sums + W, *tmp = u + W;
    real *padded = tmp + W;
    for (int b = 0; b < B; ++b) {
        const real *wb = w + (size_t)b * O * plane, *ib = in + (size_t)b * C * plane;
        const real *tb = t + (size_t)b * plane;
        real *ob = out + (size_t)b * C * plane;
        int q0 = hi(0, r0 - reach);
        for (int block = q0 - q0 % PATCH_ROWS; block < r1; block += PATCH_ROWS)
            for (int j = 0; j < n; ++j) {
                int a = da[j], c = db[j], x0 = hi(0, -c), x1 = lo(W, W - c);
                /* S_j's rows for the pairs that write rows [r0, r1): q there (ahead), q + o there (back) */
                int qs = hi(block, hi(0, lo(r0, r0 - a))), qe = lo(block + PATCH_ROWS, lo(H, hi(r1, r1 - a)));
                if (qs >= qe || x1 <= x0) continue;
                int zs = hi(0, qs - p), ze = lo(H, qe + p);
                for (int z = zs; z < ze; ++z) {
                    /* s_j's row z, zero-padded by p, then its horizontal sums */
                    real *row = rows + (size_t)(z - zs) * W;
                    memset(padded, 0, sizeof(real) * (size_t)(W + 2 * p));
                    if (z + a >= 0 && z + a < H) {
                        NAME(matches)(u, tmp, wb + (size_t)index[j] * plane + (size_t)z * W, scale[j], power, x0, x1);
                        const real *here = tb + (size_t)z * W, *there = tb + (size_t)(z + a) * W + c;
                        for (int x = x0; x < x1; ++x) padded[p + x] = u[x] * here[x] * there[x];
                    }
                    NAME(box)(row, padded, 1, m, 0, W);
                }
                for (int q = qs; q < qe; ++q) {
                    int z0 = hi(0, q - p), z1 = lo(H - 1, q + p);
                    NAME(box)(sums, rows + (size_t)(z0 - zs) * W, W, z1 - z0 + 1, 0, W);
                    if (q >= r0 && q < r1 && q + a >= 0 && q + a < H)
                        for (int ch = 0; ch < C; ++ch) {
                            real *dst = ob + ch * plane + (size_t)q * W;
                            const real *src = ib + ch * plane + (size_t)(q + a) * W + c;
                            for (int x = x0; x < x1; ++x) dst[x] += sums[x] * src[x];
                        }
                    if ((a != 0 || c != 0) && q + a >= r0 && q + a < r1)
                        for (int ch = 0; ch < C; ++ch) {
                            real *dst = ob + ch * plane + (size_t)(q + a) * W + c;
                            const real *src = ib + ch * plane + (size_t)q * W;
                            for (int x = x0; x < x1; ++x) dst[x] += sums[x] * src[x];
                        }
                }
            }
    }
    free(buf);
    return 0;
}

#if REAL_IS_DOUBLE
typedef long long bits;
#define EXPONENT 52
#define BIAS 1023
#else
typedef int bits;
#define EXPONENT 23
#define BIAS 127
#endif

/* e^x for x in [−87, 0], in a form the compiler vectorises: x = n·ln 2 + r with |r| ≤ ln 2 / 2
   (ln 2 in two parts, Cody and Waite's reduction), e^r by its Taylor polynomial to the term below
   the type's rounding (r^6/6! in float, r^13/13! in double), times 2^n made from its bits. */
static inline real NAME(expo)(real x) {
    const real log2e = (real)1.4426950408889634, ln2_hi = (real)0.693145751953125,
               ln2_lo = (real)1.428606820309417232e-6;
    real k = x * log2e;
    bits n = (bits)(k < 0 ? k - (real)0.5 : k + (real)0.5);
    real r = (x - (real)n * ln2_hi) - (real)n * ln2_lo;
#if REAL_IS_DOUBLE
    real poly = 1.0 / 6227020800.0;
    const real c[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                      1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,     1.0 / 120.0,
                      1.0 / 24.0,        1.0 / 6.0,        0.5,             1.0,
                      1.0};
    for (int i = 0; i < 13; ++i) poly = poly * r + c[i];
#else
    real poly = 1.0f / 720.0f;
    const real c[] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; ++i) poly = poly * r + c[i];
#endif
    bits scale = (n + BIAS) << EXPONENT;
    real two;
    memcpy(&two, &scale, sizeof two);
    return poly * two;
}

/* The guided kernel's weight maps: out[b,j,y] = k_j · e^{max(inv[b]·D_j(y), cutoff)}, 0 where that
   exponential is at most floor or y + o_j is outside the image (y a pixel (row, column)), with the
   patch distance D_j(y) = Σ_{|e|≤p} Σ_ch (P[b,ch,y+e] − P[b,ch,y+e+o_j])² in P's coordinates
   shifted by p: P (B, c, H+2p, W+2p) is the guide mirrored by p; each pixel's squared differences
   summed over the channels in order, then a box of rows' horizontal sums as in kdeq_patch. The taps
   k (n,); out (B, n, H, W), for the rows of [r0, r1). */
static int NAME(distances_rows)(const real *P, int c, int B, int H, int W, int p, const int *da,
                                 const int *db, const real *taps, int n, const real *inv, real cutoff,
                                 real floor, real *out, int r0, int r1) {
    int hp = H + 2 * p, wp = W + 2 * p, m = 2 * p + 1;
    size_t pplane = (size_t)hp * wp, plane = (size_t)H * W;
    real *buf = malloc(sizeof(real) * ((size_t)(2 * m + 1) * W + wp));
    if (!buf) return 1;
    real *ring = buf, *sums = ring + (size_t)2 * m * W, *sq = sums + W;
    for (int b = 0; b < B; ++b) {
        const real *pb = P + (size_t)b * c * pplane;
        for (int j = 0; j < n; ++j) {
            int a = da[j], d = db[j], next = r0;
            /* the columns of the guide's pairs within P, and of the weights' within the image */
            int u0 = hi(0, -d), u1 = lo(wp, wp - d), x0 = hi(0, -d), x1 = lo(W, W - d);
            for (int y = r0; y < r1; ++y) {
                real *dst = out + ((size_t)b * n + j) * plane + (size_t)y * W;
                if (y + a < 0 || y + a >= H || x1 <= x0) {
                    memset(dst, 0, sizeof(real) * (size_t)W);
                    continue;
                }
                for (next = hi(next, y); next < y + m; ++next) {
                    const real *g = pb + (size_t)next * wp, *h = pb + (size_t)(next + a) * wp + d;
                    for (int x = u0; x < u1; ++x) sq[x] = (g[x] - h[x]) * (g[x] - h[x]);
                    for (int ch = 1; ch < c; ++ch) {
                        g += pplane, h += pplane;
                        for (int x = u0; x < u1; ++x) sq[x] += (g[x] - h[x]) * (g[x] - h[x]);
                    }
                    /* each row twice, m rows apart, so that rows y … y + 2p lie in order from y mod m */
                    real *row = ring + (size_t)(next % m) * W;
                    NAME(box)(row, sq, 1, m, x0, x1);
                    memcpy(row + (size_t)m * W + x0, row + x0, sizeof(real) * (size_t)(x1 - x0));
                }
                NAME(box)(sums, ring + (size_t)(y % m) * W, W, m, x0, x1);
                memset(dst, 0, sizeof(real) * (size_t)x0);
                for (int x = x0; x < x1; ++x) {
                    real v = sums[x] * inv[b];
                    real e = NAME(expo)(v < cutoff ? cutoff : v);
                    dst[x] = (e > floor ? e : 0) * taps[j];
                }
                memset(dst + x1, 0, sizeof(real) * (size_t)(W - x1));
            }
        }
    }
    free(buf);
    return 0;
}

int NAME(kdeq_patch)(const real *w, int O, const int *index, const int *da, const int *db,
                     const real *scale, int n, int power, const real *t, int p, const real *in, int C,
                     real *out, int B, int H, int W, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int i = omp_get_thread_num(), k = omp_get_num_threads();
        failed |= NAME(patch_rows)(w, O, index, da, db, scale, n, power, t, p, in, C, out, B, H, W,
                                   H * i / k, H * (i + 1) / k);
    }
    return failed;
}

int NAME(kdeq_distances)(const real *P, int c, int B, int H, int W, int p, const int *da, const int *db,
                         const real *taps, int n, const real *inv, real cutoff, real floor, real *out,
                         int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int i = omp_get_thread_num(), k = omp_get_num_threads();
        failed |= NAME(distances_rows)(P, c, B, H, W, p, da, db, taps, n, inv, cutoff, floor, out,
                                       H * i / k, H * (i + 1) / k);
    }
    return failed;
}

/* Block matching's running selection (kdeq.maths.collab.matches), for the references [g0, g1): reference
   g at pixel r = refs[g] of an H×W image keeps its K best candidates so far, scores[g] highest first
   and members[g] their pixels. The n offsets o_j = (da[j], db[j]) give, in this order, every forward
   candidate z = r + o_j inside the image with score w[j](r), then every backward one z = r − o_j
   (o_j ≠ 0) inside it with score w[j](r − o_j); w (n, H, W). `self` scores the candidate of o_0 = 0,
   the reference itself, 2 (above any weight). A candidate enters after every entry of at least its
   score: the lists are a stable sort, highest first, of all candidates in the order they came. */
static void NAME(select_refs)(const real *w, int n, const int *da, const int *db, int H, int W,
                              const int64_t *refs, real *scores, int64_t *members, int K, int self,
                              int64_t g0, int64_t g1) {
    size_t plane = (size_t)H * W;
    for (int64_t g = g0; g < g1; ++g) {
        int64_t r = refs[g];
        int ry = (int)(r / W), rx = (int)(r % W);
        real *s = scores + (size_t)g * K;
        int64_t *m = members + (size_t)g * K;
        for (int back = 0; back < 2; ++back) {
            for (int j = 0; j < n; ++j) {
                int a = back ? -da[j] : da[j], b = back ? -db[j] : db[j];
                int zy = ry + a, zx = rx + b;
                if ((back && a == 0 && b == 0) || zy < 0 || zy >= H || zx < 0 || zx >= W) continue;
                int64_t z = (int64_t)zy * W + zx;
                real v = w[(size_t)j * plane + (size_t)(back ? z : r)];
                if (self && !back && j == 0) v = 2;
                if (!(v > s[K - 1])) continue;
                int at = K - 1;
                for (; at > 0 && s[at - 1] < v; --at) {
                    s[at] = s[at - 1];
                    m[at] = m[at - 1];
                }
                s[at] = v;
                m[at] = z;
            }
        }
    }
}

void NAME(kdeq_select)(const real *w, int n, const int *da, const int *db, int H, int W,
                       const int64_t *refs, int64_t G, real *scores, int64_t *members, int K, int self,
                       int threads) {
#pragma omp parallel num_threads(threads)
    {
        int i = omp_get_thread_num(), k = omp_get_num_threads();
        NAME(select_refs)(w, n, da, db, H, W, refs, scores, members, K, self, G * i / k, G * (i + 1) / k);
    }
}
