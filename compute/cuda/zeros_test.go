package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// The deferred zeros (zeros.go): each consumer, given a gradient Zero left
// pending, gives what it adds to a gradient holding written zeros (the
// kernels bit for bit: their sums start from 0 either way; the GEMM's and
// cuDNN's outputs the same values, a zero's sign aside), with no memset;
// and the bookkeeping never lets a call see a buffer that is not zero
// where Zero left it.

// zerosAlike fails t unless got and want hold the same values, bit for
// bit but for the sign of zeros when signed is false.
func zerosAlike(t *testing.T, what string, got, want []float32, signed bool) {
	t.Helper()
	for i := range want {
		g, w := got[i], want[i]
		if math.Float32bits(g) != math.Float32bits(w) && (signed || g != 0 || w != 0) {
			t.Fatalf("%s: element %d = %v (%#08x) after a deferred zero, %v (%#08x) after written zeros", what, i, g, math.Float32bits(g), w, math.Float32bits(w))
		}
	}
}

// garbage returns a tensor of dtype dt with n elements at offset shift of
// its allocation, holding garbage: the tests Zero it right before the
// consumer (any other call between, FromF32 included, flushes the zero);
// written holds zeros written from the host instead (nothing pending).
func garbage(be *Backend, r *rand.Rand, dt compute.DType, n, shift int) compute.Tensor {
	return placed(be, dt, vecValues(r, n, 1), shift)
}

func written(be *Backend, dt compute.DType, n, shift int) compute.Tensor {
	return placed(be, dt, make([]float32, n), shift)
}

// checkNoMemset fails t if the profile since its last reset ran a memset,
// or did not run each of the kernels want.
func checkNoMemset(t *testing.T, be *Backend, what string, want ...string) {
	t.Helper()
	calls := profileCalls(be)
	if calls["memset"] != 0 {
		t.Fatalf("%s: %d memsets after a deferred zero; the calls were %v", what, calls["memset"], calls)
	}
	for _, k := range want {
		if calls[k] == 0 {
			t.Fatalf("%s: %s did not run; the calls were %v", what, k, calls)
		}
	}
}

func TestDeferredZeroKernels(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(91, 92))
	// SwiGLU's backward: dgate and dup zeroed, F32 or BF16, on the 8-wide
	// kernel (shift 0) and the scalar one (shift 1).
	for _, n := range []int{8, 1000, 8*300 + 8} {
		g, u, d := vecValues(r, n, 6), vecValues(r, n, 2), vecValues(r, n, 1)
		for _, obf := range []bool{false, true} {
			for shift, kernel := range []string{"k_swiglu_bwd_x8", "k_swiglu_bwd"} {
				what := fmt.Sprintf("swiglu_bwd n=%d dgate, dup %s shift %d", n, dtName(obf), shift)
				dt, gt, ut := placed(be, compute.F32, d, shift), placed(be, compute.BF16, g, shift), placed(be, compute.BF16, u, shift)
				wg, wu := written(be, dtOf(obf), n, shift), written(be, dtOf(obf), n, shift)
				be.SwiGLUBackward(wg, wu, dt, gt, ut, n)
				zg, zu := garbage(be, r, dtOf(obf), n, shift), garbage(be, r, dtOf(obf), n, shift)
				be.Profile()
				be.Zero(zg)
				be.Zero(zu)
				be.SwiGLUBackward(zg, zu, dt, gt, ut, n)
				checkNoMemset(t, be, what, kernel)
				zerosAlike(t, what+" dgate", readF32(be, zg, n), readF32(be, wg, n), true)
				zerosAlike(t, what+" dup", readF32(be, zu, n), readF32(be, wu, n), true)
			}
		}
	}
	// RMSNorm's backward: dx zeroed (the q/k norms' BF16 one, an F32 one,
	// and an F32 one with its BF16 copy: the residual stream's), on the
	// warp and block geometries, 8-wide and scalar.
	for _, sh := range [][2]int{{37, 128}, {5, 4096}, {9, 72}} {
		rows, dim := sh[0], sh[1]
		x, d, wv := vecValues(r, rows*dim, 3), vecValues(r, rows*dim, 1), vecValues(r, dim, 1.5)
		rs := make([]float32, rows)
		for i := range rs {
			rs[i] = 0.25 + r.Float32()
		}
		for _, kind := range []string{"bf16 dx", "f32 dx", "f32 dx + copy"} {
			for shift := range 2 {
				what := fmt.Sprintf("rmsnorm_bwd %dx%d %s shift %d", rows, dim, kind, shift)
				dt, xt, wt, rt := placed(be, compute.F32, d, shift), placed(be, compute.BF16, x, shift), be.FromF32(wv), be.FromF32(rs)
				dxt := map[bool]compute.DType{true: compute.BF16, false: compute.F32}[kind == "bf16 dx"]
				run := func(dx compute.Tensor, zero bool) []float32 {
					c, dw := placed(be, compute.BF16, vecValues(r, rows*dim, 1), shift), be.New(compute.F32, dim)
					be.Profile()
					if zero {
						be.Zero(dx)
					}
					if kind == "f32 dx + copy" {
						be.RMSNormBackwardCopy(dx, c, dw, dt, xt, wt, rt, rows, dim)
						return append(readF32(be, dx, rows*dim), readF32(be, c, rows*dim)...)
					}
					be.RMSNormBackward(dx, dw, dt, xt, wt, rt, rows, dim)
					return readF32(be, dx, rows*dim)
				}
				want := run(written(be, dxt, rows*dim, shift), false)
				got := run(garbage(be, r, dxt, rows*dim, shift), true)
				checkNoMemset(t, be, what)
				zerosAlike(t, what, got, want, true)
			}
		}
	}
}

// TestDeferredZeroGEMM: MatMulBackward's dx, F32 and BF16 (attention's
// dout), zeroed: the GEMM writes it (beta 0).
func TestDeferredZeroGEMM(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(93, 94))
	for _, sh := range [][3]int{{33, 70, 48}, {3, 5, 7}} {
		m, n, k := sh[0], sh[1], sh[2]
		x, w, dout, dw0 := randF32(r, m*k), randF32(r, n*k), randF32(r, m*n), randF32(r, n*k)
		for _, dxt := range []compute.DType{compute.F32, compute.BF16} {
			what := fmt.Sprintf("matmul_bwd m%d n%d k%d dx %v", m, n, k, dxt)
			run := func(dx compute.Tensor, zero bool) (gx, gw []float32) {
				dw, dt, xt, wt := be.FromF32(dw0), be.FromF32(dout), be.FromF32(x), be.FromF32(w)
				be.Profile()
				if zero {
					be.Zero(dx)
				}
				be.MatMulBackward(dx, dw, nil, dt, xt, wt, m, n, k)
				return readF32(be, dx, m*k), readF32(be, dw, n*k)
			}
			wx, ww := run(written(be, dxt, m*k, 0), false)
			gx, gw := run(garbage(be, r, dxt, m*k, 0), true)
			checkNoMemset(t, be, what)
			zerosAlike(t, what+" dx", gx, wx, false)
			zerosAlike(t, what+" dw", gw, ww, true)
		}
	}
}

// TestDeferredZeroAttention: cuDNN's attention backward into zeroed dq,
// dk (F32) and dv (BF16, written by cuDNN in place; or F32), in one call
// and in two calls on views of the samples' runs in order (the decoder's
// attnGroups), against written zeros; and the own kernels, which add,
// with the zeros flushed before them.
func TestDeferredZeroAttention(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	if be.dnn == nil {
		t.Fatal("cuDNN did not load (the emulator stands in for it)")
	}
	r := rand.New(rand.NewPCG(95, 96))
	eachAttnBackwardMode(t, be, func(t *testing.T, c attnBackwardMode) {
		ac := newAttnCase(r, []int{1, 17, 65, 2}, c.nHead, c.nKV, c.hd)
		o, lse := ac.run(oracle, ac.q, ac.k, ac.v)
		dout := randF32(r, len(o))
		for _, dvt := range []compute.DType{compute.BF16, compute.F32} {
			for _, split := range []bool{false, true} {
				what := fmt.Sprintf("attention backward dv %v split %v", dvt, split)
				H, KV, D := c.nHead, c.nKV, c.hd
				run := func(dq, dk, dv compute.Tensor, zero bool) []float32 {
					ins := []compute.Tensor{be.FromF32(dout), be.FromF32(ac.q), be.FromF32(ac.k), be.FromF32(ac.v), be.FromF32(o), be.FromF32(lse)}
					// one call, or samples [0, 2) then [2, 4) on views
					type run struct {
						tok0, n, nSeq int
						st            compute.Tensor
					}
					runs := []run{{0, ac.tokens, len(ac.lens), be.FromI32(ac.starts)}}
					if split {
						cut := int(ac.starts[2])
						runs = []run{{0, cut, 2, be.FromI32(ac.starts[:3])},
							{cut, ac.tokens - cut, 2, be.FromI32([]int32{0, ac.starts[3] - ac.starts[2], ac.starts[4] - ac.starts[2]})}}
					}
					dnn := be.dnn.calls[1]
					be.Profile()
					if zero {
						be.Zero(dq)
						be.Zero(dk)
						be.Zero(dv)
					}
					for _, g := range runs {
						vq := func(x compute.Tensor) compute.Tensor { return be.View(x, g.tok0*H*D, g.n*H*D) }
						vk := func(x compute.Tensor) compute.Tensor { return be.View(x, g.tok0*KV*D, g.n*KV*D) }
						be.AttentionBackward(vq(dq), vk(dk), vk(dv), vq(ins[0]), vq(ins[1]), vk(ins[2]), vk(ins[3]), vq(ins[4]),
							be.View(ins[5], g.tok0*H, g.n*H), g.st, g.nSeq, ac.maxLen, g.n, H, KV, D, float32(1/math.Sqrt(float64(D))))
					}
					if on := be.dnn.calls[1] != dnn; on != (c.mode == "") {
						t.Fatalf("mode %q: the backward ran on cuDNN: %v", c.mode, on)
					}
					return append(append(readF32(be, dq, len(ac.q)), readF32(be, dk, len(ac.k))...), readF32(be, dv, len(ac.v))...)
				}
				want := run(written(be, compute.F32, len(ac.q), 0), written(be, compute.F32, len(ac.k), 0), written(be, dvt, len(ac.v), 0), false)
				got := run(garbage(be, r, compute.F32, len(ac.q), 0), garbage(be, r, compute.F32, len(ac.k), 0), garbage(be, r, dvt, len(ac.v), 0), true)
				calls := profileCalls(be)
				if c.mode == "" {
					if calls["memset"] != 0 || calls["k_bf16_to_f32_x4"] == 0 {
						t.Fatalf("%s: want no memset and the widening k_bf16_to_f32_x4; the calls were %v", what, calls)
					}
					for _, k := range []string{"k_add_bf16", "k_add_bf16_x4", "k_add_bf16_act", "k_add_bf16_act_x4"} {
						if calls[k] != 0 {
							t.Fatalf("%s: %s ran %d times into zeroed gradients", what, k, calls[k])
						}
					}
				} else if calls["memset"] == 0 {
					t.Fatalf("%s: the own kernels add: the zeros must be flushed first; calls %v", what, calls)
				}
				zerosAlike(t, what, got, want, c.mode != "")
			}
		}
	})
}

// TestDeferredZeroBookkeeping: what a call sees of Zero's buffers.
func TestDeferredZeroBookkeeping(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(97, 98))
	m, n, k := 6, 8, 5
	x, w, dout := randF32(r, m*k), randF32(r, n*k), randF32(r, m*n)
	ones := func(c int) []float32 {
		v := make([]float32, c)
		for i := range v {
			v[i] = 1
		}
		return v
	}
	allZero := func(what string, v []float32) {
		t.Helper()
		for i, f := range v {
			if f != 0 {
				t.Fatalf("%s: element %d = %v, want 0", what, i, f)
			}
		}
	}
	t.Run("consumer writes a prefix", func(t *testing.T) {
		// dx has more elements than the GEMM writes: its tail stays zero
		// (flushed: it is part of an operand).
		dx, dw, dt, xt, wt := be.FromF32(ones(m*k+9)), be.FromF32(make([]float32, n*k)), be.FromF32(dout), be.FromF32(x), be.FromF32(w)
		be.Zero(dx)
		be.MatMulBackward(dx, dw, nil, dt, xt, wt, m, n, k)
		got := readF32(be, dx, m*k+9)
		allZero("dx's tail", got[m*k:])
		ref := written(be, compute.F32, m*k, 0)
		be.MatMulBackward(ref, be.FromF32(make([]float32, n*k)), nil, be.FromF32(dout), be.FromF32(x), be.FromF32(w), m, n, k)
		zerosAlike(t, "dx", got[:m*k], readF32(be, ref, m*k), false)
	})
	t.Run("zeroed input", func(t *testing.T) {
		// A pending zero the consumer reads (dout) is flushed before it.
		d, dx, dw, xt, wt := be.FromF32(dout), be.FromF32(ones(m*k)), be.FromF32(ones(n*k)), be.FromF32(x), be.FromF32(w)
		be.Zero(d)
		be.MatMulBackward(dx, dw, nil, d, xt, wt, m, n, k)
		zerosAlike(t, "dx += 0·w", readF32(be, dx, m*k), ones(m*k), true)
		zerosAlike(t, "dw += 0ᵀ·x", readF32(be, dw, n*k), ones(n*k), true)
	})
	t.Run("zeroed beside", func(t *testing.T) {
		// Two pending zeros; the consumer takes one, the other stays
		// pending and a later read sees zeros.
		a, b, dt, wt := be.FromF32(ones(m*k)), be.FromF32(ones(64)), be.FromF32(dout), be.FromF32(w)
		be.Zero(a)
		be.Zero(b)
		be.MatMulBackward(a, nil, nil, dt, nil, wt, m, n, k)
		if len(be.zeros) != 1 {
			t.Fatalf("%d pending zeros after the consumer, want 1 (b's)", len(be.zeros))
		}
		allZero("b", readF32(be, b, 64))
		if len(be.zeros) != 0 {
			t.Fatalf("%d pending zeros after a read", len(be.zeros))
		}
	})
	t.Run("overlapping zeros", func(t *testing.T) {
		// Zero(dx) then Zero(a view inside it): the view's range overlaps
		// dx, so it is zeroed before the GEMM writes dx whole.
		dx, dt, wt := be.FromF32(ones(m*k)), be.FromF32(dout), be.FromF32(w)
		be.Zero(dx)
		be.Zero(be.View(dx, 3, 7))
		be.MatMulBackward(dx, nil, nil, dt, nil, wt, m, n, k)
		ref := written(be, compute.F32, m*k, 0)
		be.MatMulBackward(ref, nil, nil, be.FromF32(dout), nil, be.FromF32(w), m, n, k)
		zerosAlike(t, "dx", readF32(be, dx, m*k), readF32(be, ref, m*k), false)
	})
	t.Run("not a consumer", func(t *testing.T) {
		// Any other call flushes first: Scale of a zeroed tensor is 0.
		v := be.FromF32(ones(100))
		be.Profile() // (it enters: a zero pending before it is flushed)
		be.Zero(v)
		be.Scale(v, 100, 2)
		if calls := profileCalls(be); calls["memset"] != 1 {
			t.Fatalf("Scale after Zero: %d memsets, want 1; calls %v", calls["memset"], calls)
		}
		allZero("v", readF32(be, v, 100))
	})
	t.Run("eager", func(t *testing.T) {
		e := testBackendWith(t, Options{EagerZeros: true})
		v := e.FromF32(ones(10))
		e.Zero(v)
		if len(e.zeros) != 0 {
			t.Fatalf("EagerZeros: %d pending zeros after Zero", len(e.zeros))
		}
		allZero("v", readF32(e, v, 10))
	})
}
