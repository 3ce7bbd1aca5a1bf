package loss

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"distill/train/internal/ref"
)

// multiCase is one (divergence, tail, temperature) configuration of the
// multi-teacher tests: every tail mode, every divergence it allows.
type multiCase struct {
	kd    Divergence
	beta  float64
	tail  Tail
	T, Tc float64
	t2    bool
	sft   float64
}

func multiCases() []multiCase {
	var cs []multiCase
	for _, d := range []struct {
		kd   Divergence
		beta float64
	}{{FwdKL, 0}, {RevKL, 0}, {JSD, 0.3}} {
		cs = append(cs,
			multiCase{d.kd, d.beta, Bucket, 1, 1, false, 0.5},
			multiCase{d.kd, d.beta, Bucket, 1.5, 1.5, true, 0},
			multiCase{d.kd, d.beta, Renormalize, 2, 1, true, 0.4},
			multiCase{d.kd, d.beta, Renormalize, 1, 1, false, 0})
	}
	return append(cs,
		multiCase{FwdKL, 0, Zero, 1, 1, false, 0.5},
		multiCase{FwdKL, 0, Zero, 0.5, 1.5, false, 0})
}

func (c multiCase) String() string {
	return fmt.Sprintf("%s(%g)/%s/T=%g/Tc=%g/t2=%v/sft=%g", c.kd, c.beta, c.tail, c.T, c.Tc, c.t2, c.sft)
}

func (c multiCase) opts() Options {
	return Options{KD: c.kd, Beta: c.beta, Tail: c.tail, Temperature: c.T, TeacherTemperature: c.Tc,
		ScaleT2: c.t2, KDWeight: 0.8, SFTWeight: c.sft}
}

// teacherOf is the single teacher of b as a Teachers entry.
func teacherOf(b *batch, w float64) Teacher {
	return Teacher{Weight: w, K: b.K, TopIDs: b.tg.TopIDs, TopLP: b.tg.TopLP}
}

// multi returns b's targets with the given teachers instead of its own.
func multi(b *batch, ts ...Teacher) *Targets {
	tg := b.tg
	tg.K, tg.TopIDs, tg.TopLP = 0, nil, nil
	tg.Teachers = ts
	return &tg
}

func runBoth(t *testing.T, b *batch, tg *Targets, o Options) (Stats, []float32, []float32) {
	t.Helper()
	dx, dw := make([]float32, len(b.x)), make([]float32, len(b.w))
	st, err := (&Head{V: b.V, C: b.C, TileCols: 7}).fwdBwd(b.x, b.w, dx, dw, tg, &o, 0)
	if err != nil {
		t.Fatal(err)
	}
	return st, dx, dw
}

// TestMultiOneTeacherExact: one teacher of weight 1 through Teachers is
// the single-teacher path bit for bit (same union, no padding, the same
// float64 operations), and two identical teachers at 0.5/0.5 are too
// (0.5·a + 0.5·a = a exactly in binary floating point): tolerance 0.
func TestMultiOneTeacherExact(t *testing.T) {
	for _, c := range multiCases() {
		t.Run(c.String(), func(t *testing.T) {
			b := newBatch(11, 6, 50, 5)
			o := c.opts()
			want, wdx, wdw := runBoth(t, b, &b.tg, o)
			for _, ts := range [][]Teacher{{teacherOf(b, 1)}, {teacherOf(b, 0.5), teacherOf(b, 0.5)}} {
				st, dx, dw := runBoth(t, b, multi(b, ts...), o)
				if st.Loss != want.Loss || st.KD != want.KD || st.CE != want.CE || st.Tokens != want.Tokens {
					t.Fatalf("%d teachers: stats %+v, single teacher %+v", len(ts), st, want)
				}
				for i, ts := range st.Teachers {
					if ts.KD != want.KD {
						t.Fatalf("teacher %d: kd %v, single teacher %v", i, ts.KD, want.KD)
					}
				}
				for i := range dx {
					if dx[i] != wdx[i] {
						t.Fatalf("%d teachers: dx[%d] = %v, single teacher %v", len(ts), i, dx[i], wdx[i])
					}
				}
				for i := range dw {
					if dw[i] != wdw[i] {
						t.Fatalf("%d teachers: dw[%d] = %v, single teacher %v", len(ts), i, dw[i], wdw[i])
					}
				}
			}
		})
	}
}

// TestMultiWeightZero: teachers A and B (different top-k sets, B with a
// different k) at weights 1/0 give teacher A alone. B's ids widen the
// union, so A's tail is a sum over more terms and the gradient on B's ids
// comes from host coefficients (float64 q_v rounded to fp32) instead of
// the kernel's fp32 A·q_v. The terms of A's tail at B's ids are exp of
// the fp32 logits taken in float64 on the host where the kernel takes
// them in fp32: each differs by a few fp32 ulps (~1e-7 relative), which
// the tail's share of the loss damps, so the loss agrees to 1e-8 relative
// (observed <= 1e-10); the gradients agree to 1e-5 relative + 1e-7 (a
// few fp32 ulps per coefficient, accumulated over V in fp32).
func TestMultiWeightZero(t *testing.T) {
	for _, c := range multiCases() {
		t.Run(c.String(), func(t *testing.T) {
			a, bb := newBatch(11, 6, 50, 5), newBatch(12, 6, 50, 3)
			bb.x, bb.w, bb.tg.Tokens, bb.tg.Mask, bb.tg.Starts = a.x, a.w, a.tg.Tokens, a.tg.Mask, a.tg.Starts
			o := c.opts()
			want, wdx, wdw := runBoth(t, a, &a.tg, o)
			st, dx, dw := runBoth(t, a, multi(a, teacherOf(a, 1), teacherOf(bb, 0)), o)
			closeRel(t, "loss", st.Loss, want.Loss, 0, 1e-8)
			closeRel(t, "kd", st.KD, want.KD, 0, 1e-8)
			closeRel(t, "teacher 0 kd", st.Teachers[0].KD, want.KD, 0, 1e-8)
			if st.CE != want.CE {
				t.Fatalf("ce %v, single teacher %v", st.CE, want.CE)
			}
			bst, _, _ := runBoth(t, bb, &bb.tg, o)
			closeRel(t, "teacher 1 kd", st.Teachers[1].KD, bst.KD, 0, 1e-8)
			for i := range dx {
				closeRel(t, fmt.Sprintf("dx[%d]", i), float64(dx[i]), float64(wdx[i]), 1e-7, 1e-5)
			}
			for i := range dw {
				closeRel(t, fmt.Sprintf("dw[%d]", i), float64(dw[i]), float64(wdw[i]), 1e-7, 1e-5)
			}
		})
	}
}

// TestMultiGradients: two DIFFERENT teachers (top-5 and top-3 of two
// different distributions, so the union has ids outside each teacher's
// set and rows are padded) at weights 0.7/0.45, in every tail mode: the
// loss against Σ_t w_t·(float64 reference of teacher t alone), each
// teacher's divergence against the reference's, and the gradients
// against central finite differences of that sum (the single-teacher
// tolerances of TestLossAndGradients).
func TestMultiGradients(t *testing.T) {
	for _, c := range multiCases() {
		t.Run(c.String(), func(t *testing.T) {
			C, V := 6, 50
			a, bb := newBatch(11, C, V, 5), newBatch(21, C, V, 3)
			ws := []float64{0.7, 0.45}
			o := c.opts()
			tg := multi(a, teacherOf(a, ws[0]), Teacher{Weight: ws[1], K: 3, TopIDs: bb.tg.TopIDs, TopLP: bb.tg.TopLP})
			st, dx, dw := runBoth(t, a, tg, o)
			xd, wd := ref.F64(a.x), ref.F64(a.w)
			teachers := []*batch{a, bb}
			f := func() (total, ce float64, kds []float64) {
				for i, tb := range teachers {
					ro := a.refOpts(o)
					ro.KDWeight, ro.SFTW = o.KDWeight*ws[i], 0
					l, kd, c := ref.KDLoss(xd, wd, C, V, a.tg.Tokens, a.tg.Starts, a.tg.Mask, tb.K, tb.tg.TopIDs, tb.tg.TopLP, ro)
					total += l
					ce = c
					kds = append(kds, kd)
				}
				return total + o.SFTWeight*ce, ce, kds
			}
			want, wce, wkds := f()
			closeRel(t, "loss", st.Loss, want, 1e-6, lossRtol)
			closeRel(t, "ce", st.CE, wce, 1e-6, lossRtol)
			closeRel(t, "kd", st.KD, ws[0]*wkds[0]+ws[1]*wkds[1], 1e-6, lossRtol)
			for i := range wkds {
				closeRel(t, fmt.Sprintf("teacher %d kd", i), st.Teachers[i].KD, wkds[i], 1e-6, lossRtol)
			}
			fl := func() float64 { l, _, _ := f(); return l }
			gx, gw := ref.Grad(fl, xd, nil, 1e-5), ref.Grad(fl, wd, nil, 1e-5)
			for i := range gx {
				closeRel(t, fmt.Sprintf("dx[%d]", i), float64(dx[i]), gx[i], gradAtol, gradRtol)
			}
			for i := range gw {
				closeRel(t, fmt.Sprintf("dw[%d]", i), float64(dw[i]), gw[i], gradAtol, gradRtol)
			}
			// Forward alone gives the same numbers.
			st2, err := (&Head{V: V, C: C}).fwd(a.x, a.w, tg, &o)
			if err != nil || math.Abs(st2.Loss-st.Loss) > 1e-6*math.Abs(st.Loss)+1e-7 {
				t.Fatalf("Forward = %v, %v; ForwardBackward gave %v", st2, err, st)
			}
		})
	}
}

// TestMultiTop1: per-teacher top-1 agreement against the student's argmax
// computed directly in float64, with a flat student (the union's argmax
// rarely exceeds the mass outside the union: the LM head top-1 decides)
// and a peaked one (the bound decides), each path taken at least once.
func TestMultiTop1(t *testing.T) {
	C, V := 6, 50
	for _, scale := range []float32{1, 8} {
		a, bb := newBatch(11, C, V, 5), newBatch(21, C, V, 3)
		for i := range a.w {
			a.w[i] *= scale
		}
		// Make teacher B's top-1 the student's argmax at some positions,
		// so that agreement is neither 0 nor 1.
		z := func(tt, v int) float64 {
			var s float64
			for i := 0; i < C; i++ {
				s += float64(a.x[tt*C+i]) * float64(a.w[v*C+i])
			}
			return s
		}
		argmax := func(tt int) int32 {
			best := 0
			for v := 1; v < V; v++ {
				if z(tt, v) > z(tt, best) {
					best = v
				}
			}
			return int32(best)
		}
		N := len(a.tg.Tokens)
		for tt := 0; tt < N; tt += 2 {
			am := argmax(tt)
			row := bb.tg.TopIDs[tt*3 : tt*3+3]
			for j := range row {
				if row[j] == am {
					row[j] = row[0]
				}
			}
			row[0] = am
		}
		tg := multi(a, teacherOf(a, 1), Teacher{Weight: 1, K: 3, TopIDs: bb.tg.TopIDs, TopLP: bb.tg.TopLP})
		o := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
		h := &Head{V: V, C: C, TileCols: 7}
		st, err := h.fwd(a.x, a.w, tg, &o)
		if err != nil {
			t.Fatal(err)
		}
		for i, te := range tg.Teachers {
			agree, n := 0, 0
			for s := 0; s+1 < len(a.tg.Starts); s++ {
				for tt := int(a.tg.Starts[s]); tt+1 < int(a.tg.Starts[s+1]); tt++ {
					if a.tg.Mask[tt+1] == 0 {
						continue
					}
					n++
					if argmax(tt) == te.TopIDs[tt*te.K] {
						agree++
					}
				}
			}
			if want := float64(agree) / float64(n); st.Teachers[i].Top1 != want {
				t.Errorf("scale %g: teacher %d: top-1 agreement %v, want %v (%d of %d)", scale, i, st.Teachers[i].Top1, want, agree, n)
			}
			if i == 1 && (agree == 0 || agree == n) {
				t.Errorf("scale %g: teacher 1 agrees at %d of %d positions: the test wants both outcomes", scale, agree, n)
			}
		}
		if scale == 1 && h.topkRows == 0 {
			t.Errorf("flat student: no position went to the LM head's top-1")
		}
		if scale == 8 && h.topkRows == len(h.rows) {
			t.Errorf("peaked student: every position (%d) went to the LM head's top-1; the bound decided none", h.topkRows)
		}
	}
}

func TestMultiInvalid(t *testing.T) {
	a, bb := newBatch(1, 4, 20, 3), newBatch(2, 4, 20, 2)
	if a.tg.Mask[8] != 1 {
		t.Fatal("position 7 must be counted for this test")
	}
	good := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
	for _, c := range []struct {
		name string
		edit func(tg *Targets)
		want string
	}{
		{"both", func(tg *Targets) { tg.K, tg.TopIDs, tg.TopLP = a.K, a.tg.TopIDs, a.tg.TopLP }, "set only Teachers"},
		{"weight", func(tg *Targets) { tg.Teachers[1].Weight = -1 }, "teacher 1: weight -1"},
		{"nanWeight", func(tg *Targets) { tg.Teachers[0].Weight = math.NaN() }, "teacher 0: weight NaN"},
		{"allZero", func(tg *Targets) { tg.Teachers[0].Weight, tg.Teachers[1].Weight = 0, 0 }, "every teacher's weight is 0"},
		{"k", func(tg *Targets) { tg.Teachers[1].K = 3 }, "teacher 1: top-k has 26 ids"},
		{"k0", func(tg *Targets) { tg.Teachers[0].K = 0 }, "teacher 0: k = 0"},
		{"dup", func(tg *Targets) { tg.Teachers[1].TopIDs[7*2+1] = tg.Teachers[1].TopIDs[7*2] }, "teacher 1: top-k at token 7 lists id"},
		{"id", func(tg *Targets) { tg.Teachers[1].TopIDs[7*2] = 20 }, "teacher 1: top-k at token 7, rank 0: id 20"},
		{"lp", func(tg *Targets) { tg.Teachers[0].TopLP[7*3+2] = 0.5 }, "teacher 0: log-prob at token 7, rank 2"},
		{"token", func(tg *Targets) { tg.Tokens = append([]int32{21}, tg.Tokens[1:]...) }, "token 0 has id 21"},
	} {
		tg := multi(a, Teacher{Weight: 1, K: 3, TopIDs: append([]int32(nil), a.tg.TopIDs...), TopLP: append([]float32(nil), a.tg.TopLP...)},
			Teacher{Weight: 1, K: 2, TopIDs: append([]int32(nil), bb.tg.TopIDs...), TopLP: append([]float32(nil), bb.tg.TopLP...)})
		tg.Teachers = append([]Teacher(nil), tg.Teachers...)
		c.edit(tg)
		o := good
		_, err := (&Head{V: 20, C: 4}).fwd(a.x, a.w, tg, &o)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want ErrInvalid mentioning %q", c.name, err, c.want)
		}
	}
}
