package computetest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"distill/compute"
)

// InverseCDF is the float64 reference of LMHeadSample's draws: for each
// uniform u (ascending or not), the smallest id v outside head whose
// cumulative probability Σ_{w<=v} p_w (ids ascending, head left out)
// exceeds u times the mass outside head, or the last id with mass when
// rounding leaves u·mass above the sum. It returns the draws and that
// mass.
func InverseCDF(p []float64, head []int32, u []float64) ([]int32, float64) {
	in := make(map[int32]bool, len(head))
	for _, id := range head {
		in[id] = true
	}
	var mass float64
	for v, pv := range p {
		if !in[int32(v)] {
			mass += pv
		}
	}
	out := make([]int32, len(u))
	for d, ud := range u {
		x := ud * mass
		var cum float64
		out[d] = -1
		last := int32(-1)
		for v, pv := range p {
			if in[int32(v)] || pv == 0 {
				continue
			}
			last, cum = int32(v), cum+pv
			if cum > x {
				out[d] = int32(v)
				break
			}
		}
		if out[d] < 0 {
			out[d] = last
		}
	}
	return out, mass
}

// CheckDraw says why got is not an acceptable draw for threshold u·mass
// of p outside head, or "" when it is: got is want (InverseCDF's), or it
// is outside head and the threshold lies within tol·mass of its step of
// the CDF, [F(got) - p_got, F(got)).
func CheckDraw(p []float64, head []int32, u float64, got, want int32, tol float64) string {
	if got == want {
		return ""
	}
	if got < 0 || int(got) >= len(p) || slices.Contains(head, got) {
		return fmt.Sprintf("drew %d, want %d (not an id outside the head)", got, want)
	}
	var mass, f float64
	for v, pv := range p {
		if slices.Contains(head, int32(v)) {
			continue
		}
		mass += pv
		if v <= int(got) {
			f += pv
		}
	}
	x, eps := u*mass, tol*mass
	if f-p[got]-eps <= x && x < f+eps {
		return ""
	}
	return fmt.Sprintf("drew %d (CDF step [%.12g, %.12g)), want %d: threshold %.12g is %.3g outside the step (tolerance %.3g)",
		got, f-p[got], f, want, x, math.Max(f-p[got]-x, x-f), eps)
}

// sampleUniforms returns tokens x n sorted uniforms, multiples of 2^-53:
// token 0's all 0, token 1's all 1-2^-53 (the last id with mass), the
// rest random.
func sampleUniforms(r *rand.Rand, tokens, n int) []float64 {
	u := make([]float64, tokens*n)
	for t := 0; t < tokens; t++ {
		row := u[t*n : (t+1)*n]
		for d := range row {
			switch t {
			case 0:
				row[d] = 0
			case 1:
				row[d] = float64(uint64(1)<<53-1) / (1 << 53)
			default:
				row[d] = float64(r.Uint64()>>11) / (1 << 53)
			}
		}
		slices.Sort(row)
	}
	return u
}

// runSample runs LMHeadSample and, for k > 0, LMHeadTopK on the same
// operands, and checks: the top-k is LMHeadTopK's bit for bit; the draws
// are the float64 inverse CDF's of the logits (the operands as the backend
// multiplies them), but where a threshold lies within CDFTol of a step;
// the draws are ascending; the tail mass is the reference's; a token with
// no mass to draw from gets -1s. It returns how many draws differed.
func (s *suite) runSample(t *testing.T, name string, xv, wv []float32, tokens, hidden, vocab, k, n int, head bool, u []float64) int {
	t.Helper()
	be := s.be
	xt, xr := s.actIn(xv)
	wt := be.FromF32(wv)
	xg, wg := s.gemmIn(xr), s.gemmIn(wv)
	ids, lps := be.New(compute.I32, tokens*k), s.garbage(tokens*k)
	drawn, tail := be.New(compute.I32, tokens*n), s.garbage(tokens)
	pu := make([]int32, 2*tokens*n)
	compute.PackUniforms(pu, u)
	be.LMHeadSample(ids, lps, drawn, tail, xt, wt, be.FromI32(pu), tokens, hidden, vocab, k, n, head)
	gotID, gotDrawn := make([]int32, tokens*k), make([]int32, tokens*n)
	be.ReadI32(ids, gotID)
	be.ReadI32(drawn, gotDrawn)
	gotLP, gotTail := s.read(lps, tokens*k), s.read(tail, tokens)
	if k > 0 {
		ids2, lps2 := be.New(compute.I32, tokens*k), s.garbage(tokens*k)
		be.LMHeadTopK(ids2, lps2, xt, wt, tokens, hidden, vocab, k)
		wantID := make([]int32, tokens*k)
		be.ReadI32(ids2, wantID)
		wantLP := s.read(lps2, tokens*k)
		for i := range wantID {
			if gotID[i] != wantID[i] || math.Float32bits(gotLP[i]) != math.Float32bits(wantLP[i]) {
				t.Fatalf("%s: top-k entry %d: (%d, %v), LMHeadTopK's (%d, %v)", name, i, gotID[i], gotLP[i], wantID[i], wantLP[i])
			}
		}
	}
	diff := 0
	for ti := 0; ti < tokens; ti++ {
		logit := make([]float64, vocab)
		mx := math.Inf(-1)
		for j := 0; j < vocab; j++ {
			var sm float64
			for q := 0; q < hidden; q++ {
				sm += float64(xg[ti*hidden+q]) * float64(wg[j*hidden+q])
			}
			logit[j] = sm
			mx = math.Max(mx, sm)
		}
		var sum float64
		for _, l := range logit {
			sum += math.Exp(l - mx)
		}
		p := make([]float64, vocab)
		for j, l := range logit {
			p[j] = math.Exp(l-mx) / sum
		}
		var hd []int32
		if head {
			hd = gotID[ti*k : (ti+1)*k]
		}
		ur := u[ti*n : (ti+1)*n]
		want, mass := InverseCDF(p, hd, ur)
		if d := math.Abs(float64(gotTail[ti]) - mass); !(d <= s.tol.CDFTol*mass+1e-30) {
			t.Fatalf("%s: token %d: tail mass %.9g, want %.9g", name, ti, gotTail[ti], mass)
		}
		got := gotDrawn[ti*n : (ti+1)*n]
		if mass == 0 {
			for d, g := range got {
				if g != -1 {
					t.Fatalf("%s: token %d: no mass outside the head, but draw %d is %d, want -1", name, ti, d, g)
				}
			}
			continue
		}
		for d := range got {
			if why := CheckDraw(p, hd, ur[d], got[d], want[d], s.tol.CDFTol); why != "" {
				t.Fatalf("%s: token %d draw %d (u %.17g): %s", name, ti, d, ur[d], why)
			}
			if got[d] != want[d] {
				diff++
			}
			if d > 0 && got[d] < got[d-1] {
				t.Fatalf("%s: token %d: draws not ascending at %d: %v", name, ti, d, got)
			}
		}
	}
	return diff
}

// lmHeadSample: the draws against the float64 inverse CDF, on a vocabulary
// that is no multiple of the tiles or the blocks, for sampled (k 0, and k
// 3 without head), head+sampled (k 5, and k 1 with one draw) and a peaked
// teacher whose head holds nearly all the mass (the tail then rests on
// the head blocks' exact sums), and a flat one (whose top-k ids hold a
// small share of their blocks).
func (s *suite) lmHeadSample(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 26))
	tokens, hidden, vocab := 37, 24, 5000
	x, w := randn(r, tokens*hidden, 1), randn(r, vocab*hidden, 1)
	peaked := slices.Clone(w)
	for j := 0; j < hidden; j++ {
		peaked[4321*hidden+j] = 2 * x[5*hidden+j] // token 5's top-1 far ahead
		peaked[64*hidden+j] = 1.5 * x[7*hidden+j] // token 7's, in a block of its own
	}
	flat := slices.Clone(x) // logits within ±0.3: no id dominates its block
	for i := range flat {
		flat[i] *= 0.02
	}
	for _, c := range []struct {
		name string
		x, w []float32
		k, n int
		head bool
	}{
		{"sampled N 50", x, w, 0, 50, false},
		{"top-3 and sampled N 7", x, w, 3, 7, false},
		{"head+sampled k 5 N 50", x, w, 5, 50, true},
		{"head+sampled k 1 N 1", x, w, 1, 1, true},
		{"peaked head+sampled k 2 N 64", x, peaked, 2, 64, true},
		{"peaked sampled N 64", x, peaked, 0, 64, false},
		{"flat head+sampled k 8 N 50", flat, w, 8, 50, true},
	} {
		u := sampleUniforms(r, tokens, c.n)
		diff := s.runSample(t, c.name, c.x, c.w, tokens, hidden, vocab, c.k, c.n, c.head, u)
		t.Logf("%s: %d of %d draws differ from the float64 reference (within CDFTol of a step)", c.name, diff, tokens*c.n)
	}
}

// lmHeadSampleEdges: exact logits (hidden 1, x 1: the logits are w) with
// ties and masses spread over the tiles; a vocabulary smaller than a block;
// a head that holds the whole vocabulary (no draws: -1s, tail mass 0).
func (s *suite) lmHeadSampleEdges(t *testing.T) {
	r := rand.New(rand.NewPCG(27, 28))
	vocab := 9000
	w := make([]float32, vocab)
	for j := range w {
		w[j] = float32(j%7) - 3
	}
	w[8999] = 4 // the last id the most likely
	for _, k := range []int{0, 4} {
		u := sampleUniforms(r, 3, 40)
		s.runSample(t, fmt.Sprintf("ties k %d", k), []float32{1, 1, 1}, w, 3, 1, vocab, k, 40, k > 0, u)
	}
	small := []float32{0.5, -1, 2, 0, 3, -2, 1, 1, 0.25, -0.5}
	s.runSample(t, "vocab 10", []float32{1, 1, 0.5}, small, 3, 1, 10, 2, 30, true, sampleUniforms(r, 3, 30))
	s.runSample(t, "vocab 10 sampled", []float32{1, 1, 0.5}, small, 3, 1, 10, 0, 30, false, sampleUniforms(r, 3, 30))
	s.runSample(t, "head holds all", []float32{1, 1, 1}, small, 3, 1, 10, 10, 5, true, sampleUniforms(r, 3, 5))
}
