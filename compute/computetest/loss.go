package computetest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"distill/compute"
)

// lossCase is a fused LM-head loss call with its float64 logits.
type lossCase struct {
	x, w          []float32
	rows, labels  []int32
	ids           []int32 // (M,K) ascending per row
	N, M, C, V, K int
	z             [][]float64 // (M) float64 logits of each counted row
}

// newLossCase draws hidden states and a head, counted rows (a subset of
// the N positions), labels and K distinct ascending teacher ids a row. Row
// 0's teacher ids get large logits, so its tail holds ~1e-9 of the mass.
func newLossCase(r *rand.Rand, N, C, V, K int) *lossCase {
	c := &lossCase{N: N, C: C, V: V, K: K, x: randn(r, N*C, 1), w: randn(r, V*C, 0.5)}
	for t := 0; t < N; t++ {
		if t%3 != 1 {
			c.rows = append(c.rows, int32(t))
			c.labels = append(c.labels, int32(r.IntN(V)))
		}
	}
	c.M = len(c.rows)
	for m := 0; m < c.M; m++ {
		perm := r.Perm(V)[:K]
		sort.Ints(perm)
		for _, v := range perm {
			c.ids = append(c.ids, int32(v))
		}
	}
	if K > 0 {
		// Row 0 (position rows[0]) puts ~all its mass on its teacher ids:
		// their head rows align with its hidden state.
		x0 := c.x[int(c.rows[0])*C : int(c.rows[0]+1)*C]
		for j := 0; j < K; j++ {
			v := int(c.ids[j])
			for i := 0; i < C; i++ {
				c.w[v*C+i] = x0[i] * float32(60/dotSelf(x0))
			}
		}
	}
	c.logits(c.x, c.w)
	return c
}

// logits sets c.z from x and w (c's own, or their BF16 roundings when the
// backend's GEMMs round them).
func (c *lossCase) logits(x, w []float32) {
	C, V := c.C, c.V
	c.z = c.z[:0]
	for m := 0; m < c.M; m++ {
		z := make([]float64, V)
		xr := x[int(c.rows[m])*C : int(c.rows[m]+1)*C]
		for v := 0; v < V; v++ {
			for i := 0; i < C; i++ {
				z[v] += float64(xr[i]) * float64(w[v*C+i])
			}
		}
		c.z = append(c.z, z)
	}
}

// newLossCase draws a lossCase whose float64 logits are those of the
// operands as the backend multiplies them (Tolerances.BF16GEMM).
func (s *suite) newLossCase(r *rand.Rand, N, C, V, K int) *lossCase {
	c := newLossCase(r, N, C, V, K)
	if s.tol.BF16GEMM {
		c.logits(s.gemmIn(c.x), s.gemmIn(c.w))
	}
	return c
}

func dotSelf(x []float32) float64 {
	var s float64
	for _, v := range x {
		s += float64(v) * float64(v)
	}
	return s
}

func (s *suite) lossHead(c *lossCase, invT float32, tileCols int) *compute.LossHead {
	be := s.be
	x, _ := s.actIn(c.x)
	h := &compute.LossHead{X: x, W: be.FromF32(c.w), Rows: be.FromI32(c.rows), Labels: be.FromI32(c.labels),
		M: c.M, C: c.C, V: c.V, K: c.K, InvT: invT, TileCols: tileCols}
	if c.K > 0 {
		h.TopIDs = be.FromI32(c.ids)
	}
	return h
}

// lossHeadForward: pass 1's statistics against float64 logits, over one
// tile and over many (a width that does not divide the vocabulary), at
// T = 1 and T = 2, with and without teacher ids.
func (s *suite) lossHeadForward(t *testing.T) {
	r := rand.New(rand.NewPCG(27, 28))
	for _, K := range []int{5, 0} {
		c := s.newLossCase(r, 40, 16, 301, K)
		for _, invT := range []float32{1, 0.5} {
			for _, tc := range []int{0, 7, 64} {
				t.Run(fmt.Sprintf("K=%d/invT=%g/tile=%d", K, invT, tc), func(t *testing.T) {
					st := s.be.LossHeadForward(s.lossHead(c, invT, tc))
					for m := 0; m < c.M; m++ {
						z := c.z[m]
						lseT, lse1 := logSumExp(z, float64(invT)), logSumExp(z, 1)
						inK := map[int]bool{}
						for j := 0; j < K; j++ {
							inK[int(c.ids[m*K+j])] = true
						}
						var tail float64
						for v, zv := range z {
							if !inK[v] {
								tail += math.Exp(zv*float64(invT) - lseT)
							}
						}
						name := fmt.Sprintf("row %d", m)
						closeTo(t, name+" LseT", []float32{float32(st.LseT[m])}, []float64{lseT}, s.tol.FwdAtol, s.tol.FwdRtol)
						closeTo(t, name+" Lse1", []float32{float32(st.Lse1[m])}, []float64{lse1}, s.tol.FwdAtol, s.tol.FwdRtol)
						// The tail is relative, however small it is (row 0's
						// is ~1e-9 of the mass).
						if d := math.Abs(st.Tail[m] - tail); !(d <= s.tol.FwdRtol*tail) {
							t.Fatalf("%s Tail = %.6g, want %.6g (relative error %.3g)", name, st.Tail[m], tail, d/tail)
						}
						closeTo(t, name+" ZLab", st.ZLab[m:m+1], []float64{z[c.labels[m]]}, s.tol.FwdAtol, s.tol.FwdRtol)
						for j := 0; j < K; j++ {
							closeTo(t, name+" ZK", st.ZK[m*K+j:m*K+j+1], []float64{z[c.ids[m*K+j]]}, s.tol.FwdAtol, s.tol.FwdRtol)
						}
					}
					if K > 0 && !(st.Tail[0] < 1e-6) {
						t.Fatalf("row 0 tail %g: the case meant it to be tiny", st.Tail[0])
					}
				})
			}
		}
	}
}

// lossHeadBackward: pass 2 against the formula of compute.LossCoef in
// float64, accumulated (+=) into non-zero dx and dw; rows that are not
// counted keep their dx.
func (s *suite) lossHeadBackward(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(29, 30))
	for _, K := range []int{5, 0} {
		c := s.newLossCase(r, 40, 16, 301, K)
		// Under BF16GEMM the backend rounds x, w and dL/dz for the
		// gradient GEMMs; the reference rounds the same.
		xg, wg := c.x, c.w
		if s.tol.BF16GEMM {
			xg, wg = s.gemmIn(c.x), s.gemmIn(c.w)
		}
		for _, invT := range []float32{1, 0.5} {
			for _, wsft := range []float32{0, 0.3} {
				if K == 0 && wsft == 0 {
					continue
				}
				for _, tc := range []int{0, 7} {
					t.Run(fmt.Sprintf("K=%d/invT=%g/wsft=%g/tile=%d", K, invT, wsft, tc), func(t *testing.T) {
						M, C, V := c.M, c.C, c.V
						lseT, lse1, a, cK := make([]float32, M), make([]float32, M), randn(r, M, 1), randn(r, M*K, 0.1)
						for m := 0; m < M; m++ {
							lseT[m], lse1[m] = float32(logSumExp(c.z[m], float64(invT))), float32(logSumExp(c.z[m], 1))
						}
						coef := &compute.LossCoef{LseT: be.FromF32(lseT), Lse1: be.FromF32(lse1), A: be.FromF32(a), WSFT: wsft}
						if K > 0 {
							coef.CK = be.FromF32(cK)
						}
						dx0, dw0 := randn(r, c.N*C, 1), randn(r, V*C, 1)
						dx, dw := be.FromF32(dx0), be.FromF32(dw0)
						be.LossHeadBackward(s.lossHead(c, invT, tc), coef, dx, dw)
						wantDX, wantDW := f64(dx0), f64(dw0)
						for m := 0; m < M; m++ {
							z := c.z[m]
							dz := make([]float64, V)
							for v := range dz {
								dz[v] = float64(a[m]) * math.Exp(z[v]*float64(invT)-float64(lseT[m]))
							}
							for j := 0; j < K; j++ {
								dz[c.ids[m*K+j]] = float64(cK[m*K+j])
							}
							for v := range dz {
								dz[v] += float64(wsft) * math.Exp(z[v]-float64(lse1[m]))
							}
							dz[c.labels[m]] -= float64(wsft)
							if s.tol.BF16GEMM {
								for v := range dz {
									dz[v] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(dz[v]))))
								}
							}
							xr := xg[int(c.rows[m])*C:]
							for v := 0; v < V; v++ {
								for i := 0; i < C; i++ {
									wantDX[int(c.rows[m])*C+i] += dz[v] * float64(wg[v*C+i])
									wantDW[v*C+i] += dz[v] * float64(xr[i])
								}
							}
						}
						s.fwd(t, "dx", s.read(dx, c.N*C), wantDX)
						s.fwd(t, "dw", s.read(dw, V*C), wantDW)
						// A frozen LM head (dw nil): no weight gradient,
						// the same dx bit for bit.
						dxf := be.FromF32(dx0)
						be.LossHeadBackward(s.lossHead(c, invT, tc), coef, dxf, nil)
						got, want := s.read(dxf, c.N*C), s.read(dx, c.N*C)
						for i := range want {
							if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
								t.Fatalf("dx with a frozen head (dw nil), element %d: %v, with dw %v", i, got[i], want[i])
							}
						}
					})
				}
			}
		}
	}
}
