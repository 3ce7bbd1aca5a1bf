package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"distill/compute"
)

// The vector kernels (k_swiglu_x8, k_rmsnorm_warp8/_block8 with and
// without the residual add, k_rmsnorm_rope8, k_swiglu_bwd_x8,
// k_rmsnorm_bwd_warp8/_block8 and their _dw twins, k_colsum_part4) must
// give the bits of the scalar kernels they stand in for where the launch
// site finds the sizes and addresses that allow them. Each case below runs an op twice on the
// same values: on tensors that start 16-byte aligned (the launch site
// picks the vector kernel) and on views one element further (the scalar
// kernel); the profile says which kernels ran, and every output is
// compared bit for bit (a BF16 output through its exact widening).
//
// The vector kernels add the float64 sums of their rows and columns
// (RMSNorm's sum of squares and dot, the column sums) in another fixed
// order; those are rounded to fp32, which hides the order unless a sum
// lands within an ulp of a rounding boundary of the fp32, and a BF16 x's
// squares add up exactly. The fixed seeds make any such case a stable
// failure, not a flaky one.

// vecValues are n values for the bit comparisons: U(-scale, scale) with
// zeros, signed zeros, subnormals and large magnitudes mixed in.
func vecValues(r *rand.Rand, n int, scale float32) []float32 {
	v := randF32(r, n)
	for i := range v {
		v[i] *= scale
		switch r.IntN(16) {
		case 0:
			v[i] = 0
		case 1:
			v[i] = float32(math.Copysign(0, -1))
		case 2:
			v[i] *= 1e-39 // subnormal in fp32 (BF16 keeps some too)
		case 3:
			v[i] *= 1e4
		}
	}
	return v
}

// placed writes vals into a fresh tensor of dtype dt at element offset
// shift of its allocation: 0 is 16-byte aligned, 1 is not (2 or 4 bytes
// past).
func placed(be *Backend, dt compute.DType, vals []float32, shift int) compute.Tensor {
	v := be.View(be.New(dt, len(vals)+shift), shift, len(vals))
	be.WriteF32(v, vals)
	return v
}

// rawBits are the bits of t's n elements as float32 (BF16 widens exactly,
// so its bits are the high halves).
func rawBits(be *Backend, t compute.Tensor, n int) []uint32 {
	f := readF32(be, t, n)
	out := make([]uint32, n)
	for i, x := range f {
		out[i] = math.Float32bits(x)
	}
	return out
}

// checkVecPath runs run(0) (aligned: the kernels vec must run) and run(1)
// (unaligned: the kernels scalar, and none of vec) and compares the
// outputs each returns bit for bit.
func checkVecPath(t *testing.T, be *Backend, what string, vec, scalar []string, run func(shift int) [][]uint32) {
	t.Helper()
	ran := func(shift int, want, not []string) {
		t.Helper()
		var names []string
		for _, e := range be.Profile() {
			names = append(names, e.Name)
		}
		for _, k := range want {
			if !slices.Contains(names, k) {
				t.Fatalf("%s (shift %d): %s did not run; the kernels were %v", what, shift, k, names)
			}
		}
		for _, k := range not {
			if slices.Contains(names, k) {
				t.Fatalf("%s (shift %d): %s ran; the kernels were %v", what, shift, k, names)
			}
		}
	}
	be.Profile() // reset
	got := run(0)
	ran(0, vec, scalar)
	want := run(1)
	ran(1, scalar, vec)
	for o := range want {
		bad, first := 0, -1
		for i := range want[o] {
			if got[o][i] != want[o][i] {
				if first < 0 {
					first = i
				}
				bad++
			}
		}
		if bad > 0 {
			i := first
			t.Errorf("%s output %d: %d of %d elements differ from the scalar kernel's; first [%d] = %#08x (%g), scalar %#08x (%g)", what, o, bad,
				len(want[o]), i, got[o][i], math.Float32frombits(got[o][i]), want[o][i], math.Float32frombits(want[o][i]))
		}
	}
}

func dtName(bf bool) string {
	if bf {
		return "bf16"
	}
	return "f32"
}

func dtOf(bf bool) compute.DType {
	if bf {
		return compute.BF16
	}
	return compute.F32
}

func TestVecSwiGLUBitIdentical(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(41, 42))
	for _, n := range []int{8, 64, 10000, 8 * 4099} {
		g, u := vecValues(r, n, 6), vecValues(r, n, 2)
		for i := 0; i < min(n, 20); i++ {
			g[i] = float32(-90 + 9*i) // saturating gates
		}
		g[n-1] = float32(math.Inf(-1))
		for _, dt := range [][3]bool{{true, true, true}, {false, false, false}, {true, false, false}, {false, true, true}} {
			ob, gb, ub := dt[0], dt[1], dt[2]
			for _, inPlace := range []bool{false, true} {
				if inPlace && ob != gb {
					continue
				}
				what := fmt.Sprintf("swiglu n=%d out %s gate %s up %s in place %v", n, dtName(ob), dtName(gb), dtName(ub), inPlace)
				checkVecPath(t, be, what, []string{"k_swiglu_x8"}, []string{"k_swiglu"}, func(shift int) [][]uint32 {
					gt, ut := placed(be, dtOf(gb), g, shift), placed(be, dtOf(ub), u, shift)
					out := gt
					if !inPlace {
						out = placed(be, dtOf(ob), make([]float32, n), shift)
					}
					be.SwiGLU(out, gt, ut, n)
					return [][]uint32{rawBits(be, out, n)}
				})
			}
		}
	}
}

// vecNormShapes are (rows, dim) that take each geometry of the 8-wide
// RMSNorm kernels (rmsnormVecLaunch): groups of 1, 4, 8 and 32 lanes with
// chunks left over in the last k, rows that end inside a warp, and the
// block kernel.
var vecNormShapes = [][2]int{{1, 8}, {5, 24}, {37, 128}, {9, 136}, {13, 1024}, {11, 520}, {3, 1032}, {2, 4096}, {1, 8192}}

func TestVecRMSNormBitIdentical(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(43, 44))
	for _, sh := range vecNormShapes {
		rows, dim := sh[0], sh[1]
		l, _, _ := rmsnormVecLaunch(rows, dim)
		scalar := rmsnormLaunch(rows, dim).kernel
		x, add := vecValues(r, rows*dim, 3), vecValues(r, rows*dim, 1)
		wv := vecValues(r, dim, 1.5)
		_, wh := roundBF16(wv)
		wb, err := be.Weight(wh)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range []compute.Tensor{wb, be.FromF32(wv)} {
			for _, xbf := range []bool{true, false} {
				for _, inPlace := range []bool{false, true} {
					what := fmt.Sprintf("rmsnorm %dx%d x %s w %v in place %v", rows, dim, dtName(xbf), w.DType(), inPlace)
					checkVecPath(t, be, what, []string{l.kernel}, []string{scalar}, func(shift int) [][]uint32 {
						xt := placed(be, dtOf(xbf), x, shift)
						out := xt
						if !inPlace {
							out = placed(be, dtOf(xbf), make([]float32, rows*dim), shift)
						}
						rstd := be.New(compute.F32, rows)
						be.RMSNorm(out, rstd, xt, w, rows, dim, 1e-6)
						return [][]uint32{rawBits(be, out, rows*dim), rawBits(be, rstd, rows)}
					})
				}
				// The residual add: a (F32) += b, written back, normed into
				// out (BF16 or F32).
				what := fmt.Sprintf("addrmsnorm %dx%d out %s w %v", rows, dim, dtName(xbf), w.DType())
				checkVecPath(t, be, what, []string{l.kernel}, []string{scalar}, func(shift int) [][]uint32 {
					a, b := placed(be, compute.F32, x, shift), placed(be, compute.F32, add, shift)
					out := placed(be, dtOf(xbf), make([]float32, rows*dim), shift)
					rstd := be.New(compute.F32, rows)
					be.AddRMSNorm(out, rstd, a, b, w, rows, dim, 1e-6)
					return [][]uint32{rawBits(be, out, rows*dim), rawBits(be, a, rows*dim), rawBits(be, rstd, rows)}
				})
			}
		}
	}
}

func TestVecRMSNormRoPEBitIdentical(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(45, 46))
	// head_dim 16..512: groups of 1 to 32 lanes; 48 and 96 leave lanes of
	// their group idle; 7·3 rows end inside a warp.
	for _, hd := range []int{16, 48, 64, 96, 128, 256, 512} {
		tokens, heads := 7, 3
		rows := tokens * heads
		x := vecValues(r, rows*hd, 3)
		wv := vecValues(r, hd, 1.5)
		_, wh := roundBF16(wv)
		wb, err := be.Weight(wh)
		if err != nil {
			t.Fatal(err)
		}
		pos := []int32{0, 1, 2, 3, 500, 4095, 30000}
		inv := make([]float32, hd/2)
		for i := range inv {
			inv[i] = float32(1 / math.Pow(1e6, float64(2*i)/float64(hd)))
		}
		cs, sn := ropeTable(pos, inv)
		for _, w := range []compute.Tensor{wb, be.FromF32(wv)} {
			for _, dt := range [][2]bool{{true, true}, {false, false}, {false, true}} {
				xbf, obf := dt[0], dt[1]
				for _, inPlace := range []bool{false, true} {
					if inPlace && xbf != obf {
						continue
					}
					what := fmt.Sprintf("rmsnorm_rope hd=%d x %s out %s w %v in place %v", hd, dtName(xbf), dtName(obf), w.DType(), inPlace)
					checkVecPath(t, be, what, []string{"k_rmsnorm_rope8"}, []string{"k_rmsnorm_rope"}, func(shift int) [][]uint32 {
						xt := placed(be, dtOf(xbf), x, shift)
						out := xt
						if !inPlace {
							out = placed(be, dtOf(obf), make([]float32, rows*hd), shift)
						}
						rstd := be.New(compute.F32, rows)
						be.RMSNormRoPE(out, rstd, xt, w, be.FromF32(cs), be.FromF32(sn), tokens, heads, hd, 1e-6)
						return [][]uint32{rawBits(be, out, rows*hd), rawBits(be, rstd, rows)}
					})
				}
			}
		}
	}
}

func TestVecSwiGLUBackwardBitIdentical(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(47, 48))
	for _, n := range []int{8, 10000, 8 * 4099} {
		g, u, d := vecValues(r, n, 6), vecValues(r, n, 2), vecValues(r, n, 1)
		dg0, du0 := vecValues(r, n, 1), vecValues(r, n, 1)
		for _, bf := range []bool{true, false} {
			// dgate and dup in F32, or BF16 (the gradients GEMMs read).
			for _, obf := range []bool{false, true} {
				what := fmt.Sprintf("swiglu_bwd n=%d g, u %s, dgate, dup %s", n, dtName(bf), dtName(obf))
				checkVecPath(t, be, what, []string{"k_swiglu_bwd_x8"}, []string{"k_swiglu_bwd"}, func(shift int) [][]uint32 {
					dg, du := placed(be, dtOf(obf), dg0, shift), placed(be, dtOf(obf), du0, shift)
					dt, gt, ut := placed(be, compute.F32, d, shift), placed(be, dtOf(bf), g, shift), placed(be, dtOf(bf), u, shift)
					// F32 gradients that start at dg, du's values: a BF16 dg,
					// du holds their sums' roundings.
					dg32, du32 := placed(be, compute.F32, readF32(be, dg, n), shift), placed(be, compute.F32, readF32(be, du, n), shift)
					be.SwiGLUBackward(dg32, du32, dt, gt, ut, n)
					be.SwiGLUBackward(dg, du, dt, gt, ut, n)
					got := [][]uint32{rawBits(be, dg, n), rawBits(be, du, n)}
					for k, want := range [][]uint32{rawBits(be, dg32, n), rawBits(be, du32, n)} {
						for i, v := range want {
							if obf {
								v = uint32(compute.F32ToBF16(math.Float32frombits(v))) << 16
							}
							if got[k][i] != v {
								t.Fatalf("%s shift %d: gradient %d [%d] = %#08x, want the F32 sum rounded: %#08x", what, shift, k, i, got[k][i], v)
							}
						}
					}
					return got
				})
			}
		}
	}
}

// TestVecRMSNormBackwardBitIdentical runs the 8-wide kernels both ways:
// with dw summed in them (the default) and with the column sums after
// them (Options.RMSNormDW "colsum").
func TestVecRMSNormBackwardBitIdentical(t *testing.T) {
	for _, colsum := range []bool{false, true} {
		t.Run(fmt.Sprintf("colsum=%v", colsum), func(t *testing.T) { testVecRMSNormBackward(t, colsum) })
	}
}

func testVecRMSNormBackward(t *testing.T, colsum bool) {
	be := testBackendWith(t, Options{Profile: true})
	be.rmsColsum = colsum
	r := rand.New(rand.NewPCG(49, 50))
	// The q/k norms' shape too: many rows of a head's 128.
	for _, sh := range append(slices.Clone(vecNormShapes), [2]int{1000, 128}) {
		rows, dim := sh[0], sh[1]
		l, _, _ := rmsnormVecLaunch(rows, dim)
		vec := []string{map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8_dw", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8_dw"}[l.kernel], "k_rmsnorm_dw_finish"}
		if colsum {
			vec = []string{map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8"}[l.kernel], "k_colsum_part4"}
		}
		scalar := map[string]string{"k_rmsnorm_warp": "k_rmsnorm_bwd_warp", "k_rmsnorm_block": "k_rmsnorm_bwd_block"}[rmsnormLaunch(rows, dim).kernel]
		x, d, dx0 := vecValues(r, rows*dim, 3), vecValues(r, rows*dim, 1), vecValues(r, rows*dim, 1)
		dw0, wv := vecValues(r, dim, 1), vecValues(r, dim, 1.5)
		rs := make([]float32, rows)
		for i := range rs {
			rs[i] = 0.25 + r.Float32()
		}
		_, wh := roundBF16(wv)
		wb, err := be.Weight(wh)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range []compute.Tensor{wb, be.FromF32(wv)} {
			for _, xbf := range []bool{true, false} {
				what := fmt.Sprintf("rmsnorm_bwd %dx%d x %s w %v", rows, dim, dtName(xbf), w.DType())
				checkVecPath(t, be, what, vec, []string{scalar, "k_colsum_part"}, func(shift int) [][]uint32 {
					dx, dw := placed(be, compute.F32, dx0, shift), placed(be, compute.F32, dw0, shift)
					be.RMSNormBackward(dx, dw, placed(be, compute.F32, d, shift), placed(be, dtOf(xbf), x, shift), w, be.FromF32(rs), rows, dim)
					return [][]uint32{rawBits(be, dx, rows*dim), rawBits(be, dw, dim)}
				})
			}
		}
		// A BF16 dx (the q/k norms' input gradient), and an F32 dx with
		// its BF16 copy (the residual stream's): the copy holds dx's
		// rounding, element for element.
		for _, kind := range []string{"bf16 dx", "f32 dx + copy"} {
			what := fmt.Sprintf("rmsnorm_bwd %dx%d %s", rows, dim, kind)
			checkVecPath(t, be, what, vec, []string{scalar, "k_colsum_part"}, func(shift int) [][]uint32 {
				dw := placed(be, compute.F32, dw0, shift)
				d, xt, rt := placed(be, compute.F32, d, shift), placed(be, compute.BF16, x, shift), be.FromF32(rs)
				if kind == "bf16 dx" {
					// The same sums into an F32 dx that starts at the BF16
					// one's values: the BF16 dx holds their roundings.
					dx := placed(be, compute.BF16, dx0, shift)
					dx32 := placed(be, compute.F32, readF32(be, dx, rows*dim), shift)
					be.RMSNormBackward(dx32, be.New(compute.F32, dim), d, xt, wb, rt, rows, dim)
					be.RMSNormBackward(dx, dw, d, xt, wb, rt, rows, dim)
					got := rawBits(be, dx, rows*dim)
					for i, v := range rawBits(be, dx32, rows*dim) {
						if want := uint32(compute.F32ToBF16(math.Float32frombits(v))) << 16; got[i] != want {
							t.Fatalf("%s shift %d: dx[%d] = %#08x, want the F32 sum %#08x rounded: %#08x", what, shift, i, got[i], v, want)
						}
					}
					return [][]uint32{got, rawBits(be, dw, dim)}
				}
				dx, dxc := placed(be, compute.F32, dx0, shift), placed(be, compute.BF16, dx0, shift)
				be.RMSNormBackwardCopy(dx, dxc, dw, d, xt, wb, rt, rows, dim)
				got, c := rawBits(be, dx, rows*dim), rawBits(be, dxc, rows*dim)
				for i, v := range got {
					if want := uint32(compute.F32ToBF16(math.Float32frombits(v))) << 16; c[i] != want {
						t.Fatalf("%s shift %d: copy[%d] = %#08x, want dx %#08x rounded: %#08x", what, shift, i, c[i], v, want)
					}
				}
				return [][]uint32{got, c, rawBits(be, dw, dim)}
			})
		}
	}
}

// TestVecColSumBitIdentical: the column sums without x (a bias's
// gradient), cols not a multiple of the 128 of a block.
func TestVecColSumBitIdentical(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(51, 52))
	for _, sh := range [][2]int{{1, 4}, {300, 132}, {70, 1028}, {5000, 8}} {
		rows, cols := sh[0], sh[1]
		src, dst0 := vecValues(r, rows*cols, 1), vecValues(r, cols, 1)
		what := fmt.Sprintf("colsum %dx%d", rows, cols)
		checkVecPath(t, be, what, []string{"k_colsum_part4"}, []string{"k_colsum_part"}, func(shift int) [][]uint32 {
			dst, s := placed(be, compute.F32, dst0, shift), placed(be, compute.F32, src, shift)
			func() {
				defer be.enter()()
				be.colSum(be.ten(dst, "dst").p, be.ten(s, "src").p, 0, 0, 0, rows, cols, 0)
			}()
			return [][]uint32{rawBits(be, dst, cols)}
		})
	}
}
