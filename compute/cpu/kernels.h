// Hot loops of the CPU backend. Each is compiled for x86-64-v4 (AVX-512),
// v3 (AVX2+FMA) and baseline, picked at load time (gcc target_clones), so one
// binary runs fast everywhere. Reductions use `omp simd` (no -ffast-math).
#include <stdint.h>

void k_rmsnorm(float *out, float *rstd, const float *x, const float *w, long rows, long dim, float eps);
void k_rmsnorm_bwd(float *dx, double *dw_acc, const float *dout, const float *x, const float *w,
                   const float *rstd, long rows, long dim);
void k_swiglu(float *out, const float *g, const float *u, long n);
void k_add(float *a, const float *b, long n);
void k_softmax_causal(float *s, long rows, long ld, long first_len, float *lse, long lse_stride);
void k_softmax_recompute(float *s, long rows, long ld, long first_len, const float *lse, long lse_stride);
void k_softmax_bwd(float *dp, const float *p, long rows, long ld, long first_len);
void k_expf(float *out, const float *x, long n);
void k_lse_topk(const float *logits, long rows, long ncols, long ld, long col0,
                float *rmax, double *rsum, int k, float *hv, int32_t *hi, int32_t *hn,
                float *ebuf, float *bsum, long ldb, long nb, float *tmax, double *tsum, long ldt, long tile,
                int32_t *hsl, float *hz);
// draw_pair is LMHeadSample's blockPair (lmsample.go): a (row, block)
// pair and its draws [d0, d1).
struct draw_pair {
	int32_t row, blk, d0, d1;
};
void k_draw_walk(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh,
                 const double *thr, int nd, int32_t *out);
void k_fast_walk(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh,
                 const double *thr, int nd, int32_t *out);
void k_head_masses(float *bs, const float *tmax, long spt, const int32_t *ids, int k, const float *z,
                   const int32_t *head, long vocab);
void k_draw_walks(const float *z, long m, int nz, const struct draw_pair *ps, const float *rmax,
                  const int32_t *heads, int k, const double *thr, int n, int32_t *drawn);
void k_dexp(double *e, const float *z, long n, double mx);
double k_tile_mass(const float *tmax, const double *tsum, long ntile, double mx, double *sc);
void k_draw_locate(const float *bs, long nblk, const double *sc, const double *tsum, long ntile, long spt,
                   const int32_t *u, int n, double mass, int32_t *blk, double *thr);
void k_block_logits(float *z, const float *x, const int32_t *rows, long m, const float *w, long nz, long hidden,
                    float *wt, const float *next, long nextz, int warm);
int k_block_sums_v4(float *bs, const float *e, long n);
void k_tile_max_sum(const float *row, long n, float *mx, float *sm, float *e, int ref);
double k_fexp_sum(const float *z, int n, float m);
double k_block_mass(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh);
double k_sumexp(const float *x, long n, float scale, float shift);
void k_scaled_exp(float *out, const float *x, long n, float scale, float shift, float mul);
void k_exp_mix(float *out, const float *x, long n, float s1, float h1, float a, float h2, float b);
void k_swiglu_bwd(float *dg, float *du, const float *dout, const float *g, const float *u, long n);
void k_adamw(float *p, const float *g, float *m, float *v, long n, float b1, float b2, float eps,
             float step, float bc2, float decay);
double k_sumsq(const float *x, long n);
void k_scale(float *x, long n, float c);
float k_absmax(const float *x, long n);
