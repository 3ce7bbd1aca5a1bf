package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"distill/compute"
)

// TestRMSNormDWFused holds RMSNorm's backward with dw summed in the row
// kernels (k_rmsnorm_bwd_*8_dw, k_rmsnorm_dw_finish; the default) to the
// two-pass path it replaces (the row kernels, then k_colsum_part4 and
// k_colsum_finish; Options.RMSNormDW "colsum"): dx and its BF16 copy bit
// for bit (the same kernels' math), dw within a float rounding (the same
// float64 sums of the same terms, added in another order), and each path
// to a float64 sum of the terms on the host. A second run of the fused
// path must repeat its bits. The shapes take each geometry: a head's 128
// over many rows (the q/k norms: 64 rows a block at a time), 1024 (a
// warp a row), 4096 and 8192 (a block a row), with the last group of rows
// short, and one with more rows than 256 groups of 16 (the group then
// grows with rows).
func TestRMSNormDWFused(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	if be.rmsColsum {
		t.Fatal("the backend runs the column sums by default; want the fused kernels")
	}
	r := rand.New(rand.NewPCG(53, 54))
	for _, sh := range [][2]int{{3000, 128}, {4500, 128}, {300, 1024}, {4100, 1024}, {70, 4096}, {20, 8192}} {
		rows, dim := sh[0], sh[1]
		l, lanes, ok := rmsnormVecLaunch(rows, dim)
		if !ok {
			t.Fatalf("%dx%d: not a shape of the 8-wide kernels", rows, dim)
		}
		group := rmsDWGroup(rows, ewThreads/int(lanes))
		if rows%group == 0 {
			t.Fatalf("%dx%d: %d rows are whole groups of %d; want a short last group", rows, dim, rows, group)
		}
		fused := map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8_dw", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8_dw"}[l.kernel]
		plain := map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8"}[l.kernel]
		x, d, dx0 := vecValues(r, rows*dim, 3), vecValues(r, rows*dim, 1), vecValues(r, rows*dim, 1)
		dw0, wv := vecValues(r, dim, 1), vecValues(r, dim, 1.5)
		rs := make([]float32, rows)
		for i := range rs {
			rs[i] = 0.25 + r.Float32()
		}
		_, wh := roundBF16(wv)
		w, err := be.Weight(wh)
		if err != nil {
			t.Fatal(err)
		}
		dt, rt := be.FromF32(d), be.FromF32(rs)
		for _, xbf := range []bool{true, false} {
			xt := placed(be, dtOf(xbf), x, 0)
			xr := readF32(be, xt, rows*dim) // x as the kernels read it
			// dw on the host: dw0 + the float64 sum of each column's fp32
			// terms rounded to fp32, as the kernels add it; and the sum
			// of the terms' magnitudes, which bounds the float64 sums'
			// errors (1e-12 of it is far above them).
			sum, mag, want := make([]float64, dim), make([]float64, dim), make([]float64, dim)
			for i := 0; i < rows; i++ {
				for c := 0; c < dim; c++ {
					v := float64(d[i*dim+c] * (xr[i*dim+c] * rs[i]))
					sum[c] += v
					mag[c] += math.Abs(v)
				}
			}
			for c := range want {
				want[c] = float64(dw0[c] + float32(sum[c]))
			}
			// dx: F32, BF16, or F32 with its BF16 copy; added to, or
			// written over a Zero (the kernels' acc 0).
			for _, kind := range []string{"f32 dx", "bf16 dx", "f32 dx + copy"} {
				for _, zeroed := range []bool{false, true} {
					what := fmt.Sprintf("%dx%d x %s, %s, zeroed %v", rows, dim, dtName(xbf), kind, zeroed)
					run := func(colsum bool) [][]uint32 {
						be.rmsColsum = colsum
						defer func() { be.rmsColsum = false }()
						dxt := placed(be, dtOf(kind == "bf16 dx"), dx0, 0)
						if zeroed {
							be.Zero(dxt)
						}
						dwt := be.FromF32(dw0)
						be.Profile() // reset
						var dxc compute.Tensor
						if kind == "f32 dx + copy" {
							dxc = be.New(compute.BF16, rows*dim)
							be.RMSNormBackwardCopy(dxt, dxc, dwt, dt, xt, w, rt, rows, dim)
						} else {
							be.RMSNormBackward(dxt, dwt, dt, xt, w, rt, rows, dim)
						}
						var names []string
						for _, e := range be.Profile() {
							names = append(names, e.Name)
						}
						ran, not := []string{fused, "k_rmsnorm_dw_finish"}, []string{plain, "k_colsum_part4", "k_colsum_finish"}
						if colsum {
							ran, not = not, ran
						}
						for _, k := range ran {
							if !slices.Contains(names, k) {
								t.Fatalf("%s (colsum %v): %s did not run; the kernels were %v", what, colsum, k, names)
							}
						}
						for _, k := range not {
							if slices.Contains(names, k) {
								t.Fatalf("%s (colsum %v): %s ran; the kernels were %v", what, colsum, k, names)
							}
						}
						out := [][]uint32{rawBits(be, dwt, dim), rawBits(be, dxt, rows*dim)}
						if dxc != nil {
							out = append(out, rawBits(be, dxc, rows*dim))
						}
						for _, x := range []compute.Tensor{dxt, dwt, dxc} {
							if x != nil {
								be.Free(x)
							}
						}
						return out
					}
					got, again, ref := run(false), run(false), run(true)
					for o := range got {
						if !slices.Equal(got[o], again[o]) {
							t.Errorf("%s: output %d of the fused path differs between two runs", what, o)
						}
					}
					for o := 1; o < len(got); o++ {
						if i := firstDiff(got[o], ref[o]); i >= 0 {
							t.Errorf("%s: output %d [%d] = %#08x, the column sums' path %#08x", what, o, i, got[o][i], ref[o][i])
						}
					}
					// dw: each path's float64 sum (within 1e-12·mag of the
					// host's) is rounded to fp32 and added to dw0 in fp32:
					// two roundings, of the sum and of the result.
					differ := 0
					for c := 0; c < dim; c++ {
						f, s := math.Float32frombits(got[0][c]), math.Float32frombits(ref[0][c])
						tol := float64(ulp32(float32(sum[c]))+ulp32(max(abs32(f), abs32(s)))) + 1e-12*mag[c]
						if dd := math.Abs(float64(f) - float64(s)); dd > tol {
							t.Errorf("%s: dw[%d] = %g, the column sums' path %g (|Δ| %g > %g)", what, c, f, s, dd, tol)
						}
						for _, v := range []float32{f, s} {
							tw := float64(ulp32(float32(sum[c]))+ulp32(v)) + 1e-12*mag[c]
							if dd := math.Abs(float64(v) - want[c]); dd > tw {
								t.Errorf("%s: dw[%d] = %g, the host's float64 sum %g (|Δ| %g > %g)", what, c, v, want[c], dd, tw)
							}
						}
						if f != s {
							differ++
						}
					}
					if differ > 0 {
						t.Logf("%s: %d of %d dw elements differ from the column sums' path (within the tolerance)", what, differ, dim)
					}
				}
			}
			be.Free(xt)
		}
		be.Free(w)
		be.Free(dt)
		be.Free(rt)
	}
}

// BenchmarkRMSNormBackward times RMSNormBackwardCopy (the residual
// stream's norms: BF16 x, an F32 dx added to, its BF16 copy) and
// RMSNormBackward (the q/k norms': BF16 x and dx) of a Qwen3-0.6B step of
// 8192 tokens, and the hidden norms of 4096 and 8192, with dw summed in
// the row kernels (fused) and by the column sums after them (colsum), on
// the same GPU in the same run: us/call, and GB/s over the bytes the
// fused path must move (dout, x, dx read and written, the copy). It needs
// a GPU; DISTILL_TRAIN_BENCH_DRYRUN=1 runs its code on the emulator at
// tiny shapes.
func BenchmarkRMSNormBackward(b *testing.B) {
	type shape struct {
		name      string
		rows, dim int
		copy      bool
	}
	shapes := []shape{{"hidden", 8192, 1024, true}, {"q-norm", 8192 * 16, 128, false}, {"k-norm", 8192 * 8, 128, false},
		{"hidden", 8192, 4096, true}, {"hidden", 8192, 8192, true}}
	switch {
	case onGPU():
	case os.Getenv("DISTILL_TRAIN_BENCH_DRYRUN") == "1":
		useEmu(b)
		shapes = []shape{{"hidden", 40, 1024, true}, {"q-norm", 300, 128, false}, {"hidden", 20, 4096, true}}
	default:
		b.Skip("benchmarks need a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh); DISTILL_TRAIN_BENCH_DRYRUN=1 runs this one's code on the emulator")
	}
	be, err := Open(Options{KernelCache: kernelCacheForTests(b)})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	r := rand.New(rand.NewPCG(55, 56))
	for _, sh := range shapes {
		n := sh.rows * sh.dim
		rs := make([]float32, sh.rows)
		for i := range rs {
			rs[i] = 0.5 + r.Float32()
		}
		x := be.New(compute.BF16, n)
		be.WriteF32(x, randF32(r, n))
		dout, rstd, w := be.FromF32(randF32(r, n)), be.FromF32(rs), be.FromF32(randF32(r, sh.dim))
		dw := be.New(compute.F32, sh.dim)
		dx, dxc := be.New(compute.BF16, n), compute.Tensor(nil)
		bytes := float64(n) * (4 + 2 + 2*2) // dout, x; dx read and written
		if sh.copy {
			dx, dxc = be.New(compute.F32, n), be.New(compute.BF16, n)
			bytes = float64(n) * (4 + 2 + 2*4 + 2)
		}
		call := func() {
			if dxc != nil {
				be.RMSNormBackwardCopy(dx, dxc, dw, dout, x, w, rstd, sh.rows, sh.dim)
			} else {
				be.RMSNormBackward(dx, dw, dout, x, w, rstd, sh.rows, sh.dim)
			}
		}
		for _, colsum := range []bool{false, true} {
			name := "fused"
			if colsum {
				name = "colsum"
			}
			b.Run(fmt.Sprintf("%s/%dx%d/%s", sh.name, sh.rows, sh.dim, name), func(b *testing.B) {
				be.rmsColsum = colsum
				defer func() { be.rmsColsum = false }()
				call()
				be.wait()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					call()
				}
				be.wait()
				sec := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(1e6*sec, "us/call")
				b.ReportMetric(bytes/sec/1e9, "GB/s")
			})
		}
		for _, t := range []compute.Tensor{x, dout, rstd, w, dw, dx, dxc} {
			if t != nil {
				be.Free(t)
			}
		}
	}
}

// TestRMSDWGroup: the fused kernels' groups are whole numbers of the
// rows a block takes at a time, at least 16 rows, and at most 256 of
// them (the partials' bound in train/plan.go: ceil(rows/16) rows of dim).
func TestRMSDWGroup(t *testing.T) {
	for _, perBlock := range []int{1, 2, 8, 32, 64, 128, 256} {
		for rows := 1; rows < 1<<20; rows = rows*3/2 + 1 {
			g := rmsDWGroup(rows, perBlock)
			np := (rows + g - 1) / g
			if g%perBlock != 0 || g < 16 || np > 256 || np > (rows+15)/16 {
				t.Errorf("rmsDWGroup(%d, %d) = %d: %d groups", rows, perBlock, g, np)
			}
		}
	}
}

// TestRMSNormDWOption: Options.RMSNormDW and $DISTILL_CUDA_RMSNORM_DW
// pick the column sums; any other value is refused.
func TestRMSNormDWOption(t *testing.T) {
	if be := testBackendWith(t, Options{RMSNormDW: "colsum"}); !be.rmsColsum {
		t.Error(`RMSNormDW "colsum": the backend runs the fused kernels`)
	}
	t.Setenv("DISTILL_CUDA_RMSNORM_DW", "colsum")
	if be := testBackendWith(t, Options{}); !be.rmsColsum {
		t.Error("DISTILL_CUDA_RMSNORM_DW=colsum: the backend runs the fused kernels")
	}
	t.Setenv("DISTILL_CUDA_RMSNORM_DW", "fused")
	if !onGPU() {
		useEmu(t)
	}
	if b, err := Open(Options{KernelCache: kernelCacheForTests(t)}); err == nil {
		b.Close()
		t.Error(`DISTILL_CUDA_RMSNORM_DW=fused: Open accepted it; want an error naming colsum`)
	} else {
		t.Log(err)
	}
}

func firstDiff(a, b []uint32) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func abs32(v float32) float32 { return float32(math.Abs(float64(v))) }

// ulp32 is the spacing of the float32 values at |v| (the smallest
// subnormal's at 0).
func ulp32(v float32) float32 {
	v = abs32(v)
	return math.Nextafter32(v, float32(math.Inf(1))) - v
}
